"""A loss that doubles within three records of a smooth run, with the gradient
norm ten times its level or more, is at least a warning however short the history; a short
healthy start (warm-up, a Hugging Face log's grad_norm 28 at step 0) is not."""

import math
import random

from helpers.detector_tester import loss_records, loud
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import AlertKind, load_policy

P = load_policy("default")

LOUD = {AlertKind.LOSS_SPIKE, AlertKind.EXPLOSION, AlertKind.DIVERGENCE, AlertKind.RUNAWAY, AlertKind.EXTREME}


def warnings(losses, norms, every=100):
    return [a for a in loud(loss_records(losses, norms, every=every)) if a.kind in LOUD]


def test_a_pretraining_loss_jumping_2x_beside_a_15x_grad_norm_warns_at_the_first_jump():
    losses = [3.32, 3.42, 3.68, 7.27, 4.13, 7.60]
    norms = [9e4, 1.0e5, 1.1e5, 1.5e6, 1.0e6, 3.0e6]  # 15x their level at the jump
    got = warnings(losses, norms)
    assert got and got[0].step == 300 and got[0].kind is AlertKind.LOSS_SPIKE, [str(a) for a in got]
    assert "2.13x its recent median 3.42" in got[0].message and "grad_norm 15x its level" in got[0].message


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    run=st.integers(3, 7),
    level=st.floats(0.5, 10.0),
    noise=st.floats(0.0, 0.03),
    rise_records=st.integers(1, 3),
    jump=st.floats(2.2, 6.0),
    grad_up=st.floats(10.5, 19.0),
    grad_level=st.floats(1e-2, 1e6),
)
def test_a_smooth_run_whose_loss_doubles_with_the_gradients_ten_times_up_is_a_warning(
    seed, run, level, noise, rise_records, jump, grad_up, grad_level
):
    rng = random.Random(seed)
    losses = [level * math.exp(noise * rng.uniform(-1, 1)) for _ in range(run)]
    norms = [grad_level * math.exp(0.1 * rng.uniform(-1, 1)) for _ in range(run)]
    for k in range(1, rise_records + 1):  # the loss reaches `jump` x its level within three records
        losses.append(level * jump ** (k / rise_records))
        norms.append(max(norms[:run]) * grad_up)  # >= grad_up x their level
    got = warnings(losses, norms)
    assert got and got[0].step <= 100 * (len(losses) - 1), (losses, norms)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(2, 8),
    start=st.floats(0.5, 11.0),
    grad0=st.floats(5.0, 50.0),
    warm=st.floats(1.0, 12.0),
)
def test_short_healthy_starts_do_not_warn(seed, n, start, grad0, warm):
    """Warm-ups: the loss falls (or wobbles) while the gradient norm settles from a large first
    value (a Hugging Face log's grad_norm 28 at step 0) or grows as the learning rate ramps up."""
    rng = random.Random(seed)
    losses = [start * (0.93**i) * math.exp(0.05 * rng.uniform(-1, 1)) for i in range(n)]
    settle = [grad0] + [grad0 / 10 * math.exp(0.2 * rng.uniform(-1, 1)) for _ in range(n - 1)]
    ramp = [0.5 * warm ** (i / max(1, n - 1)) for i in range(n)]  # up to 12x over the warm-up, loss falling
    assert warnings(losses, settle, every=10) == []
    assert warnings(losses, ramp, every=10) == []


def test_a_doubling_loss_without_the_gradients_behind_it_keeps_the_short_history_factor():
    """The first records of a fine-tune can double the loss on a hard batch: without a gradient
    jump a short history still asks for 2 x 8 = 16x."""
    assert warnings([1.0, 1.02, 0.99, 2.3], [3.0, 3.1, 2.9, 3.3]) == []
