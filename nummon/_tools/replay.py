"""Replay: the same detectors over recorded traces (no torch import).

A step number that goes backwards or repeats (a resumed or restarted run appended to the same
file) starts a new segment: a one-line warning names file:line and the detectors start afresh,
so no alert of one segment is raised or cleared by the other's steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .._core.types import Alert, StepRecord
from .._engine.segments import SegmentedEngine
from .._logs.trace import WarnFn, iter_steps
from .._policy.policy import Policy, PolicyLike, load_policy

__all__ = ["iter_replay", "iter_replay_records", "replay"]

_log = logging.getLogger("nummon")


OnRecord = Callable[[StepRecord], None]


def iter_replay(
    path: str | Path, policy: PolicyLike = None, warn: WarnFn | None = None, on_record: OnRecord | None = None
) -> Iterator[Alert]:
    """Alerts as the detectors raise them over one JSONL trace, in step order, streaming.

    Warnings (unreadable lines skipped, a new segment) go to `warn` (default: the "nummon"
    logger); TraceError when the file is not a trace or holds no readable step record.
    `on_record` sees each record read (e.g. to tell an empty log from a healthy one)."""
    pol: Policy = load_policy(policy)
    warn = warn or _log.warning
    engine = SegmentedEngine(pol)
    for lineno, rec in iter_steps(Path(path), warn):
        if on_record is not None:
            on_record(rec)
        got = engine.step(rec)
        if engine.restarted_after is not None:
            warn(
                f"{path}:{lineno}: step {rec.step} after step {engine.restarted_after}: a new segment, detectors restarted"
            )
        yield from got.alerts


def iter_replay_records(
    records: Iterable[StepRecord],
    policy: PolicyLike = None,
    warn: WarnFn | None = None,
    source: str = "log",
    on_record: OnRecord | None = None,
) -> Iterator[Alert]:
    """Alerts over records read by any reader (TensorBoard, HF, CSV, W&B), in order; a step
    that goes backwards starts a new segment, as in `iter_replay` (named to `warn` when given)."""
    pol: Policy = load_policy(policy)
    engine = SegmentedEngine(pol)
    for rec in records:
        if on_record is not None:
            on_record(rec)
        got = engine.step(rec)
        if engine.restarted_after is not None and warn is not None:
            warn(f"{source}: step {rec.step} after step {engine.restarted_after}: a new segment, detectors restarted")
        yield from got.alerts


def replay(path: str | Path, policy: PolicyLike = None, warn: WarnFn | None = None) -> list[Alert]:
    """Every alert the detectors raise over one JSONL trace, in step order."""
    return list(iter_replay(path, policy, warn))
