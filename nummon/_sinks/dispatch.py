"""Fan-out of step records, histograms, alerts and incident events to sinks, off the training thread.

Each sink runs on its own worker thread behind a bounded queue, so a slow sink delays only
itself. Every wait on a sink is bounded (policy `sinks.*_timeout_s`) and logged when it is hit:
a full queue in block mode, a critical alert being written, `close()`. Step records may be
dropped (counted); alerts never are. A sink may count the step records it took but could not
deliver (`undelivered(final)`: a failed batch; with `final`, what it still holds): they are
counted as dropped too, and so is every step record still queued for a sink that `close()`
gave up on. A sink that raises, even `SystemExit`, is isolated: the
error is logged once, counted, and the other sinks keep running.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from .._core.events import IncidentEvent
from .._core.types import Alert, Health, IncidentState, StepRecord
from .builtin import RunContext, Sink, as_sink, sink_name

__all__ = ["SinkDispatcher"]

log = logging.getLogger("nummon")


class _Worker:
    """One sink on its own thread: a bounded queue of step events, an unbounded one of alerts."""

    def __init__(self, sink: Sink, name: str, queue_size: int, block_timeout_s: float | None) -> None:
        self.sink = sink
        self.name = name
        self.queue_size = queue_size
        self.block_timeout_s = block_timeout_s  # None: drop at once when full
        self.steps: collections.deque = collections.deque()
        self.alerts: collections.deque = collections.deque()
        # guards every field below: the training thread and this sink's worker both write them
        self.cv = threading.Condition()
        self.closing = False
        self.errors = 0
        self.dropped = 0
        self.stuck = False  # a bounded wait on this sink timed out and it has not caught up since
        self.gave_up = False  # close() stopped waiting for this sink: what it holds is lost with the process
        self._reported: set[str] = set()
        self.thread = threading.Thread(target=self._run, name=f"nummon-sink-{name}", daemon=True)
        self.thread.start()

    def put_step(self, item: tuple) -> None:
        with self.cv:
            if len(self.steps) >= self.queue_size and self.block_timeout_s and not self.stuck:
                deadline = time.monotonic() + self.block_timeout_s
                while len(self.steps) >= self.queue_size and self.thread.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.stuck = True
                        self._warn_once(
                            "block",
                            "nummon: sink %s made no room within %.1f s (sinks.block_timeout_s); "
                            "dropping its step records until it catches up",
                            self.name,
                            self.block_timeout_s,
                        )
                        break
                    self.cv.wait(left)
            if len(self.steps) >= self.queue_size:
                self.dropped += 1  # statistics may be dropped; alerts never are
                return
            self.steps.append(item)
            self.cv.notify_all()

    def put_alert(self, method: str, payload: Any) -> None:
        """An alert or incident event: never dropped, handled before queued step records."""
        with self.cv:
            self.alerts.append((method, payload))
            self.cv.notify_all()

    def marker(self) -> threading.Event:
        """An event set once everything queued before it has been handled and the sink flushed."""
        done = threading.Event()
        with self.cv:
            self.steps.append(("flush", done))  # markers bypass the size limit
            self.cv.notify_all()
        return done

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        with self.cv:  # either thread may be first: the check and the mark are one step
            first = key not in self._reported
            self._reported.add(key)
        if first:  # logged outside the lock: a slow log handler holds up neither thread
            log.warning(msg, *args)

    def mark_stuck(self, stuck: bool) -> None:
        with self.cv:
            self.stuck = stuck

    def counts(self) -> tuple[int, int]:
        """(errors, dropped step records), read together: those dropped at a full queue, those
        the sink says it could not deliver, and once close gave up on it, those still queued."""
        with self.cv:
            errors, dropped, final = self.errors, self.dropped, self.gave_up
            if final:
                dropped += sum(1 for item in self.steps if item[0] == "step")
        undelivered = getattr(self.sink, "undelivered", None)
        if callable(undelivered):
            try:
                dropped += int(undelivered(final))
            except Exception:  # a sink's own count must never break the statistics
                pass
        return errors, dropped

    def call(self, method: str, *args: Any) -> None:
        try:
            getattr(self.sink, method)(*args)
        except BaseException as e:  # isolate: not even SystemExit from a sink may stop training
            with self.cv:
                self.errors += 1
            self._warn_once(
                "error",
                "nummon: sink %s failed in %s (%s: %s); further errors are counted, not logged",
                self.name,
                method,
                type(e).__name__,
                e,
            )

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
                    break
            if kind == "alert":
                self.call(item[0], item[1])
            elif item[0] == "step":
                if item[3] is not None:  # the state travels with its step: an event may have overtaken it
                    self.call("on_incident_state", item[3])
                self.call("on_step", item[1], item[2])
            elif item[0] == "hist":
                self.call("on_histograms", item[1], item[2])
            elif item[0] == "flush":
                self.call("flush")
                self.mark_stuck(False)
                item[1].set()
        self.call("flush")
        self.call("close")

    def stop(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()


class SinkDispatcher:
    """Fans step records, histograms and alerts out to every sink.

    Synchronous sinks (console output) are called on the training thread; the others each on a
    worker thread of their own.
    """

    def __init__(self, sinks: list[Any], queue_size: int = 1024, block_timeout_s: float | None = None) -> None:
        # every sink as the complete protocol (NummonError for an object that is no sink at all)
        self.sinks: list[Sink] = [as_sink(s) for s in sinks]
        names = _unique_names(self.sinks)
        self._sync = [(s, n) for s, n in zip(self.sinks, names) if s.synchronous]
        self.workers = [
            _Worker(s, n, queue_size, block_timeout_s) for s, n in zip(self.sinks, names) if not s.synchronous
        ]
        self._sync_errors = {n: 0 for _, n in self._sync}
        self._closed = False

    @property
    def wants_histograms(self) -> bool:
        return any(s.wants_histograms for s in self.sinks)

    def bind(self, context: RunContext) -> None:
        for s, n in self._sync:
            self._call_sync(s, n, "bind", context)
        for w in self.workers:  # before the worker sees any item: called here, the queues are empty
            w.call("bind", context)

    def _call_sync(self, sink: Sink, name: str, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except BaseException as e:
            self._sync_errors[name] += 1
            if self._sync_errors[name] == 1:
                log.warning(
                    "nummon: sink %s failed in %s (%s: %s); further errors are counted, not logged",
                    name,
                    method,
                    type(e).__name__,
                    e,
                )

    def step(self, record: StepRecord, health: Health | None, incident_state: IncidentState | None = None) -> None:
        """One step's record, with the run's incident state after that step's report (each sink
        gets it through `on_incident_state` just before the record, in order)."""
        for s, n in self._sync:
            if incident_state is not None and hasattr(s, "on_incident_state"):
                self._call_sync(s, n, "on_incident_state", incident_state)
            self._call_sync(s, n, "on_step", record, health)
        for w in self.workers:
            w.put_step(("step", record, health, incident_state if hasattr(w.sink, "on_incident_state") else None))

    def histograms(self, step: int, hists: dict[str, Any]) -> None:
        for s, n in self._sync:
            if s.wants_histograms:
                self._call_sync(s, n, "on_histograms", step, hists)
        for w in self.workers:
            if w.sink.wants_histograms:
                w.put_step(("hist", step, hists))

    def alert(self, alert: Alert) -> None:
        self._urgent("on_alert", alert)

    def incident(self, event: IncidentEvent) -> None:
        """An incident event, for the sinks that notify people."""
        self._urgent("on_incident", event)

    def _urgent(self, method: str, payload: Any) -> None:
        for s, n in self._sync:
            self._call_sync(s, n, method, payload)
        for w in self.workers:
            w.put_alert(method, payload)

    def flush(self, timeout: float, durable_only: bool = False) -> bool:
        """Wait, at most `timeout` seconds in all, until every sink (`durable_only`: every
        durable event log) has written what it was given and flushed; a sink that does not is
        logged and skipped next time until it catches up."""
        for s, n in self._sync:
            if s.durable or not durable_only:
                self._call_sync(s, n, "flush")
        waits = []
        for w in self.workers:
            if w.stuck:  # one read of a flag the worker may clear: skipping once more is harmless
                continue
            done = w.marker()  # the others flush what they hold soon, without anyone waiting for them
            if w.sink.durable or not durable_only:
                waits.append((w, done))
        deadline = time.monotonic() + timeout
        ok = True
        for w, done in waits:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                ok = False
                w.mark_stuck(True)
                w._warn_once(
                    "flush",
                    "nummon: sink %s did not write within %.1f s; training goes on without waiting for it",
                    w.name,
                    timeout,
                )
        return ok

    def close(self, timeout: float) -> None:
        """Let every sink write what it holds, flush and close, in parallel, within `timeout` seconds."""
        if self._closed:
            return
        self._closed = True
        for s, n in self._sync:
            self._call_sync(s, n, "flush")
            self._call_sync(s, n, "close")
        for w in self.workers:
            w.stop()
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                with w.cv:
                    w.gave_up = True
                log.warning(
                    "nummon: sink %s did not close within %.1f s (sinks.close_timeout_s); closing without it",
                    w.name,
                    timeout,
                )

    def stats(self) -> dict[str, dict[str, int]]:
        """Errors and dropped step records per sink (keys: class name, `#2`, `#3`... for repeats)."""
        out = {n: {"errors": e, "dropped": 0} for n, e in self._sync_errors.items()}
        out.update({w.name: dict(zip(("errors", "dropped"), w.counts())) for w in self.workers})
        return out


def _unique_names(sinks: list[Sink]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for s in sinks:
        base = sink_name(s)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names
