"""Properties every detector must keep, checked by hypothesis over generated loss curves:
a falling noisy loss never warns, LLM-style loss spikes that recover are never critical, the
scale-free detectors ignore the loss's units, and rows without a loss change nothing."""

import math

from helpers.detector_tester import alert_keys, engine_alerts, loss_records_at, loud, unit_noise
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import Severity, StepRecord, load_policy

# ln k matching is the one rule tied to the loss's units (nats of a k-class classifier)
SCALE_FREE = load_policy({"stall": {"chance_match": 0.0}})


@st.composite
def falling_curves(draw):
    """(step, loss) of a loss falling geometrically to 1-50% of its start, logged every 1-50 steps
    for 20-300 records, by at least 0.4% per record, with noise (up to 2%) no larger than the fall
    over 1.25 records: a trend that stands out of the noise within the ten records a window
    needs. (A fall of 0.2% per record under 2% noise cannot be told from a stall in ten records,
    nor by a person reading the log.)"""
    n = draw(st.integers(20, 300))
    every = draw(st.integers(1, 50))
    start = draw(st.floats(0.05, 50.0))
    end_fraction = draw(st.floats(0.01, min(0.5, math.exp(-0.004 * (n - 1)))))
    rate = math.log(end_fraction) / (n - 1)
    noise = draw(st.floats(0.0, 1.0)) * min(0.02, 1.25 * abs(rate))
    u = unit_noise(draw(st.integers(0, 2**30)), n)
    return [(i * every, start * math.exp(rate * i) * (1 + noise * u[i])) for i in range(n)]


@settings(max_examples=80, deadline=None)
@given(falling_curves())
def test_a_falling_noisy_loss_never_warns(points):
    got = loud(loss_records_at(points))
    assert got == []


@st.composite
def pretraining_with_spikes(draw):
    """A GPT-2-style pretraining log: loss 10.9 -> ~3 (power law, 1-3% noise), grad norm ~1, logged
    every 1-20 steps; 1-3 spikes where the loss jumps 1.5-10x and the grad norm 1-50x for 1-4
    records, then decays back to the curve."""
    n = draw(st.integers(80, 300))
    every = draw(st.integers(1, 20))
    noise = draw(st.floats(0.01, 0.03))
    u = unit_noise(draw(st.integers(0, 2**30)), 2 * n)
    loss = [(3.0 + 7.9 * (1 + i / 10) ** -0.8) * (1 + noise * u[i]) for i in range(n)]
    grad = [1.0 * (1 + 0.2 * u[n + i]) for i in range(n)]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(10, n - 5))
        loss_jump = draw(st.floats(1.5, 10.0))
        grad_jump = draw(st.floats(1.0, 50.0))
        length = draw(st.integers(1, 4))
        for j in range(length):
            if at + j < n:
                fade = 0.5**j  # back to the curve geometrically
                loss[at + j] *= 1 + (loss_jump - 1) * fade
                grad[at + j] *= 1 + (grad_jump - 1) * fade
    return [(i * every, loss[i], grad[i]) for i in range(n)]


@settings(max_examples=80, deadline=None)
@given(pretraining_with_spikes())
def test_llm_loss_spikes_that_recover_are_at_most_a_warning(points):
    """nanoGPT/llm.c-style spikes (3 -> 8 -> 3) recover by themselves: waking someone at night
    (a critical alert, stop_on_critical) for one would teach them to mute nummon."""
    got = engine_alerts(StepRecord(step=s, loss=v, grad_norm=g) for s, v, g in points)
    assert [a for a in got if a.severity is Severity.CRITICAL] == []


@st.composite
def any_loss_curves(draw):
    """Loss curves of every shape: a random walk in log space (falls, climbs, plateaus, jumps),
    logged every 1-10 steps; values exp(x), so no two records stand at a threshold ratio exactly."""
    n = draw(st.integers(5, 200))
    every = draw(st.integers(1, 10))
    drift = draw(st.floats(-0.05, 0.05))
    vol = draw(st.floats(0.0, 0.5))
    u = unit_noise(draw(st.integers(0, 2**30)), n)
    x, out = draw(st.floats(-3.0, 3.0)), []
    for i in range(n):
        x = max(-8.0, min(8.0, x + drift + vol * u[i]))
        out.append((i * every, math.exp(x)))
    return out


@settings(max_examples=80, deadline=None)
@given(any_loss_curves(), st.integers(-10, 10))
def test_scaling_the_loss_never_changes_the_alerts(points, power):
    """Spike, runaway, divergence, stall and oscillation judge ratios: a loss in other units
    (x 2**power, exact in floating point) raises the same alerts at the same steps."""
    scale = 2.0**power
    base = alert_keys(engine_alerts(loss_records_at(points), SCALE_FREE))
    scaled = alert_keys(engine_alerts(loss_records_at((s, v * scale) for s, v in points), SCALE_FREE))
    assert scaled == base


@settings(max_examples=80, deadline=None)
@given(any_loss_curves(), st.data())
def test_records_without_a_loss_change_nothing(points, data):
    """Hugging Face logs interleave eval-only rows (no training loss) with the training rows:
    inserting such rows anywhere leaves every alert as it was."""
    doubled = [(2 * s, v) for s, v in points]  # odd steps are free for the inserted rows
    inserted = data.draw(st.sets(st.sampled_from([s + 1 for s, _ in doubled]), max_size=len(doubled)))
    plain = alert_keys(engine_alerts(loss_records_at(doubled)))
    rows = sorted([(s, v) for s, v in doubled] + [(s, None) for s in inserted])
    mixed = alert_keys(engine_alerts(loss_records_at(rows)))
    assert mixed == plain
