"""Segments of a log: a step that goes backwards or repeats starts a fresh health engine."""

from __future__ import annotations

from .._core.types import StepRecord
from .._policy.policy import Policy
from .engine import HealthEngine
from .outcome import StepOutcome
from .warm import WARM_FIRST, WARM_RECENT

__all__ = ["SegmentedEngine"]


class SegmentedEngine:
    """One health engine per segment of a log: a step that goes backwards or repeats (a resumed,
    rewritten or re-run log appended to the same place) starts a fresh engine, so no alert of
    one segment is raised or cleared by another's steps; incident numbers go on, so no event id
    repeats. Serves replay and watch alike."""

    def __init__(self, policy: Policy, *, warm_first: int = WARM_FIRST, warm_recent: int = WARM_RECENT) -> None:
        self.policy = policy
        self._warm = (warm_first, warm_recent)
        self.engine = self._fresh()
        self.last_step: int | None = None  # the step of the last record (None before the first)
        self.segments = 0  # segments started after the first
        self.restarted_after: int | None = None  # the last record began a segment: the step before it

    def _fresh(self) -> HealthEngine:
        return HealthEngine(self.policy, warm_first=self._warm[0], warm_recent=self._warm[1])

    def step(self, rec: StepRecord) -> StepOutcome:
        """The record's judged outcome, in a fresh engine when it starts a new segment."""
        self.restarted_after = None
        if self.last_step is not None and rec.step <= self.last_step:
            number = self.engine._incidents.number
            self.engine = self._fresh()
            self.engine._incidents.number = number
            self.segments += 1
            self.restarted_after = self.last_step
        got = self.engine.step(rec)
        self.last_step = rec.step
        return got
