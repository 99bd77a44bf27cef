"""Oscillation means oscillation: structured swings, not minibatch noise at a plateau, and not a rise."""
import math
import random

from nummon import StepRecord
from nummon._engine import HealthEngine
from nummon._policy import load_policy


def kinds(losses):
    engine = HealthEngine(load_policy("default"))
    return [a.kind.value for i, v in enumerate(losses) for a in engine.step(StepRecord(step=i, loss=v)).alerts
            if a.severity.rank >= 1]


def fall_then(plateau):
    """The plateau from the start (a window that holds a fall sees progress, whatever follows)."""
    return plateau


def test_minibatch_noise_at_a_plateau_is_not_oscillation():
    rng = random.Random(0)
    plateau = [2.0 * math.exp(rng.gauss(0, 0.3)) for _ in range(300)]  # independent batch-to-batch noise
    assert "oscillation" not in kinds(fall_then(plateau))


def test_a_rise_during_warm_up_is_not_oscillation():
    rng = random.Random(1)
    losses = [2.0 * (1 + 0.004 * i) * math.exp(rng.gauss(0, 0.15)) for i in range(200)]
    assert "oscillation" not in kinds(losses)


def test_waves_without_progress_are_oscillation():
    rng = random.Random(2)
    plateau = [2.0 * math.exp(0.5 * math.sin(2 * math.pi * i / 16) + rng.gauss(0, 0.05)) for i in range(300)]
    assert "oscillation" in kinds(fall_then(plateau))


def test_alternating_swings_are_oscillation():
    plateau = [2.0 * (1.6 if i % 2 else 0.6) for i in range(300)]
    assert "oscillation" in kinds(fall_then(plateau))
