"""Shared by the detector tests: the loud (warning or critical) alerts over a loss curve."""

from nummon import Severity, StepRecord, load_policy
from nummon._engine.engine import HealthEngine

P = load_policy("default")


def loud(points, policy=P):
    """Warning/critical alerts over (step, loss) points."""
    eng = HealthEngine(policy)
    out = []
    for step, loss in points:
        out += [a for a in eng.step(StepRecord(step=step, loss=loss)).alerts if a.severity is not Severity.INFO]
    return out
