"""One watched run: its follower and its health engine (whose state, incident and a bounded
history of recent records, goes into the state file to re-warm the detectors after a restart)."""

from __future__ import annotations

import time
from typing import Any

from .._core.types import StepRecord
from .._engine.engine import HealthEngine
from .._engine.segments import SegmentedEngine
from .._engine.warm import WARM_FIRST, WARM_RECENT
from .._logs.follow import Follower
from .._policy.policy import Policy
from .notices import RunIncident

__all__ = ["WatchedRun"]


class WatchedRun:
    """Memory held is bounded: `history` recent records, `first` starting records (the
    divergence baseline), the detectors' own policy-sized windows and one follower."""

    def __init__(
        self, run_id: str, follower: Follower, policy: Policy, history: int = WARM_RECENT, first: int = WARM_FIRST
    ) -> None:
        self.id = run_id
        self.follower = follower
        self.policy = policy
        self._segmented = SegmentedEngine(policy, warm_first=first, warm_recent=history)
        self.notes: list[str] = []  # one-line warnings for the watcher to print
        self.records = 0  # records processed since the run was first seen (all restarts)
        self.last_activity = time.monotonic()
        self.on_record: Any = None  # hook: on_record(run_id, record, StepOutcome) (the metrics)
        self.memory: Any = None  # reports.RunMemory when the watcher writes reports: what a page is drawn from

    def poll(self, final: bool = False, stop: Any = None, chunks: int | None = None) -> list[RunIncident]:
        """Read what is new and run it through the detectors; the incident events it caused.
        The follower reads in bounded chunks; a backlog is streamed chunk after chunk (records
        are never all held), until it is read, `chunks` chunks are read (then `backlog` is True:
        the watcher goes on with the other runs and comes back), or `stop` (an Event) is set."""
        events: list[RunIncident] = []
        n = 0
        while True:
            for rec in self.follower.poll(final=final):
                events.extend(self.process(rec))
            n += 1
            if not self.follower.more or (stop is not None and stop.is_set()) or (chunks is not None and n >= chunks):
                return events

    @property
    def engine(self) -> HealthEngine:
        """The health engine of the current segment."""
        return self._segmented.engine

    @property
    def segments(self) -> int:
        """Segments started after the first (a rewritten, rotated or re-run log)."""
        return self._segmented.segments

    @property
    def last_step(self) -> int | None:
        return self._segmented.last_step

    @last_step.setter
    def last_step(self, step: int | None) -> None:
        self._segmented.last_step = step

    @property
    def backlog(self) -> bool:
        """True while the log holds more than the last poll read."""
        return bool(self.follower.more)

    def process(self, rec: StepRecord) -> list[RunIncident]:
        # a log rewritten, rotated or re-run into the same place: its steps start over, and so
        # do the detectors (SegmentedEngine, as in replay)
        got = self._segmented.step(rec)
        if self._segmented.restarted_after is not None:
            self.notes.append(
                f"run {self.id}: step {rec.step} after step {self._segmented.restarted_after}: a new segment "
                f"(a rewritten, rotated or re-run log); detectors restarted"
            )
            if self.memory is not None:
                self.memory.clear()
        if self.on_record is not None:
            self.on_record(self.id, rec, got)
        if self.memory is not None:
            self.memory.keep(rec, got.alerts, got.incidents)
        self.records += 1
        self.last_activity = time.monotonic()
        return [RunIncident(self.id, ev) for ev in got.incidents]

    def to_state(self) -> dict[str, Any]:
        return {
            "format": self.follower.format,
            "position": self.follower.position(),
            **self.engine.state_dict(),  # incident, first, history
            "records": self.records,
            "last_step": self.last_step,
        }

    def load_state(self, d: dict[str, Any]) -> None:
        """Resume: the read position and incident state as saved; the detectors re-warmed by
        running the saved records through them (their alerts are not notified again)."""
        self.follower.restore(d.get("position") or {})
        self.engine.load_state_dict(d, origin=f"{self.id} (state)")
        self.records = int(d.get("records", 0))
        self.last_step = d.get("last_step")

    def close(self) -> None:
        self.follower.close()
