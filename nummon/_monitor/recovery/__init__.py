"""Opt-in recovery (policy section `recovery`): a pre-step gradient guard that skips a
poisoned update, host snapshots of the model and optimizer state, and rollbacks with a lower
learning rate on a critical runaway or a non-finite step."""

from ..._engine.outcome import RecoveryReport
from ._guard import GradientGuard, SkipDecision
from ._recovery import Recovery
from ._snapshot import Snapshot

__all__ = ["GradientGuard", "Recovery", "RecoveryReport", "SkipDecision", "Snapshot"]
