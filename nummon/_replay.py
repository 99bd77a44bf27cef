"""Replay: the same detectors over recorded traces (no torch import)."""
from __future__ import annotations

from pathlib import Path

from ._engine import HealthEngine
from ._policy import Policy, PolicyLike, load_policy
from ._trace import read_trace
from ._types import Alert


def replay(path: str | Path, policy: PolicyLike = None) -> list[Alert]:
    """Every alert the detectors raise over one JSONL trace, in step order."""
    pol: Policy = load_policy(policy)
    engine = HealthEngine(pol)
    alerts: list[Alert] = []
    for rec in read_trace(Path(path)):
        got, _ = engine.process(rec)
        alerts.extend(got)
    return alerts
