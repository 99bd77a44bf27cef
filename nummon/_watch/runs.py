"""One watched run: its follower and its health engine (whose state, incident and a bounded
history of recent records, goes into the state file to re-warm the detectors after a restart)."""
from __future__ import annotations

import time
from typing import Any

from .._engine import HealthEngine
from .._policy import Policy
from .._types import StepRecord
from .base import Follower
from .incidents import RunIncident

__all__ = ["WatchedRun"]


class WatchedRun:
    """Memory held is bounded: `history` recent records, `first` starting records (the
    divergence baseline), the detectors' own policy-sized windows and one follower."""

    def __init__(self, run_id: str, follower: Follower, policy: Policy, history: int = 256, first: int = 32) -> None:
        self.id = run_id
        self.follower = follower
        self.engine = HealthEngine(policy, warm_first=first, warm_recent=history)
        self.records = 0  # records processed since the run was first seen (all restarts)
        self.last_step: int | None = None
        self.last_activity = time.monotonic()
        self.on_record: Any = None  # hook: on_record(run_id, record, EngineStep) (the metrics)

    def poll(self, final: bool = False) -> list[RunIncident]:
        """Read what is new and run it through the detectors; the incident events it caused."""
        events: list[RunIncident] = []
        for rec in self.follower.poll(final=final):
            events.extend(self.process(rec))
        return events

    def process(self, rec: StepRecord) -> list[RunIncident]:
        got = self.engine.step(rec)
        if self.on_record is not None:
            self.on_record(self.id, rec, got)
        self.records += 1
        self.last_step = rec.step
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
