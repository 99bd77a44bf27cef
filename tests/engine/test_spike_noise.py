"""The loss-spike threshold scales with the run's own noise: a smooth loss that doubles has spiked,
a noisy one that doubles may not have (synthetic curves; the real-log set keeps its own verdicts)."""

import math
import random

from helpers.detector_tester import engine_alerts, loss_records


def spikes(losses):
    """The steps of the loss-spike alerts (one record per step from step 0)."""
    return [a.step for a in engine_alerts(loss_records(losses)) if a.kind.value == "loss_spike"]


def test_a_smooth_large_model_loss_jumping_2_3x_is_a_spike():
    rng = random.Random(0)
    losses = [2.2 * math.exp(rng.gauss(0, 0.015)) for _ in range(60)] + [5.1, 4.0, 2.9, 2.4, 2.3]
    assert spikes(losses)[:1] == [60]


def test_a_noisy_loss_that_doubles_once_is_not_a_spike():
    rng = random.Random(1)
    losses = [2.2 * math.exp(rng.gauss(0, 0.3)) for _ in range(60)] + [4.4, 2.0, 2.3]
    assert 60 not in spikes(losses)


def test_an_eightfold_jump_is_a_spike_whatever_the_noise_below_it():
    rng = random.Random(2)
    losses = [2.2 * math.exp(rng.gauss(0, 0.1)) for _ in range(60)] + [20.0, 2.2]
    assert 60 in spikes(losses)
