"""Oscillation means oscillation: structured swings, not minibatch noise at a plateau, and not a rise."""

import json
import math
import random

import pytest
from helpers.detector_tester import loss_records, loud
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon._engine.detectors.oscillation import wave_crossings


def kinds(losses):
    return [a.kind.value for a in loud(loss_records(losses))]


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


# ------------------------------------------------------------------ a fall onto the noise floor
def fall_onto_floor(start, floor, tau, sigma, seed, n=300):
    """A loss that falls exponentially (time constant `tau` steps) from `start` to `floor` and
    then sits there with independent lognormal batch noise of `sigma` (log units)."""
    rng = random.Random(seed)
    return [(floor + (start - floor) * math.exp(-i / tau)) * math.exp(rng.gauss(0, sigma)) for i in range(n)]


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    start=st.floats(2.0, 6.0),
    floor_fraction=st.floats(0.26, 0.6),
    tau=st.floats(8.0, 60.0),
    sigma=st.floats(0.02, 0.15),
    seed=st.integers(0, 10**6),
)
def test_a_loss_sitting_on_its_noise_floor_is_not_oscillation(start, floor_fraction, tau, sigma, seed):
    """A tiny LM's picture: the loss falls, then sits on its noise floor. A
    straight line through fall + floor leaves one bend that autocorrelates like a wave; it is not
    one (a floor above the oscillation rule's level gate, so the rule itself must tell)."""
    assert "oscillation" not in kinds(fall_onto_floor(start, start * floor_fraction, tau, sigma, seed))


@pytest.mark.parametrize("period,floor", [(30, 1.6), (60, 1.2), (60, 1.6)])
def test_waves_above_the_noise_after_a_fall_are_oscillation(period, floor):
    """The same fall, but the floor swings in waves well above its noise: still oscillation."""
    rng = random.Random(period)
    losses = [
        (floor + 3.0 * math.exp(-i / 20)) * math.exp(0.4 * math.sin(2 * math.pi * i / period) + rng.gauss(0, 0.05))
        for i in range(400)
    ]
    assert "oscillation" in kinds(losses)


def test_the_dev_corpus_oscillation_trace_is_still_caught():
    from helpers.checkout import CORPUS

    path = CORPUS / "osc_sgd_lr0.5_mom0.9_s7.jsonl"
    losses = [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]
    assert "oscillation" in kinds(losses)


@given(st.lists(st.floats(-1.0, 1.0), min_size=0, max_size=60))
def test_wave_crossings_count_only_swings_that_clear_the_noise_band(resid):
    """A constant residual never crosses; the count never exceeds the records."""
    assert 0 <= wave_crossings(resid) <= max(len(resid) - 1, 0)
    assert wave_crossings([0.3] * len(resid)) == 0
