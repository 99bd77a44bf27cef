"""A run's first records, judged without a window: a loss climbing from the start (records in a
row each above every earlier one) warns before the NaN; a falling or wobbling start, one hard
batch included, does not."""

import math
import random
import re

from helpers.detector_tester import engine_alerts, loss_records, loud
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import AlertKind, Severity
from nummon._engine.detectors.divergence import CLIMB_FACTOR, CLIMB_RECORDS, JUMP_FACTOR

INSTABILITY = {AlertKind.DIVERGENCE, AlertKind.LOSS_SPIKE, AlertKind.RUNAWAY, AlertKind.EXPLOSION}
MESSAGE = re.compile(
    r"loss climbed (\d+) records in a row within its first (\d+), each above every earlier one, to (\S+), "
    r"and stands at (\S+): (\S+)x the highest before the climb \((\S+)\); a start too short for a window"
)


def _close(text, want, digits=4):
    """`text` is `want` printed to `digits` significant digits."""
    return math.isclose(float(text), want, rel_tol=0.5 * 10 ** (1 - digits))


def test_a_ce_loss_rising_75_percent_over_5_records_into_nan_warns_before_it():
    losses = [2.30, 2.45, 2.70, 3.0, 3.5, 4.0, float("nan")]
    got = loud(loss_records(losses))
    assert got[0].kind is AlertKind.DIVERGENCE and got[0].step == 4 and got[0].severity is Severity.WARNING
    m = MESSAGE.fullmatch(got[0].message)
    assert m and m.groups() == ("4", "5", "3.5", "3.5", "1.52", "2.3"), got[0].message


def test_a_loss_2_5x_then_8x_above_every_earlier_value_warns_at_the_second_record():
    losses = [2.1, 2.0, 1.95, 5.25, 16.8, 40.0, float("nan")]
    got = loud(loss_records(losses, every=10))
    assert got[0].kind is AlertKind.DIVERGENCE and got[0].step == 40
    m = MESSAGE.fullmatch(got[0].message)
    assert m and m.groups() == ("2", "5", "16.8", "16.8", "8", "2.1"), got[0].message


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    start=st.floats(0.05, 20.0),
    pre=st.integers(1, 5),
    rate=st.floats(1.06, 2.5),
    length=st.integers(2, 6),
    every=st.integers(1, 50),
)
def test_a_climb_from_the_start_warns_at_the_record_that_crosses_with_true_numbers(
    seed, start, pre, rate, length, every
):
    """1-5 falling records, then `length` records each `rate` x the one before (a
    new high each): the first warning is at the first record where 4 new highs reach 1.5x the
    highest earlier loss, or 2 in a row each stand 2x above it, and every number it prints is true."""
    rng = random.Random(seed)
    # (falling: a record above the one before would already be a new high, part of the climb)
    head = sorted((start * 0.97**i * math.exp(0.03 * rng.uniform(-1, 1)) for i in range(pre)), reverse=True)
    base = max(head)
    climb = [base * rate ** (k + 1) for k in range(length)]
    losses = head + climb
    want = None
    for k in range(2, length + 1):
        if (k >= CLIMB_RECORDS and climb[k - 1] >= CLIMB_FACTOR * base) or climb[0] >= JUMP_FACTOR * base:
            want = k
            break
    got = [a for a in loud(loss_records(losses, every=every)) if a.kind is AlertKind.DIVERGENCE]
    if want is None:
        assert [a for a in got if a.details.get("rule") == "early_climb"] == []
        return
    first = got[0]
    assert first.step <= every * (pre + want - 1)
    if first.details.get("rule") != "early_climb":  # another divergence rule (the rebound) came first
        return
    assert first.step == every * (pre + want - 1)
    m = MESSAGE.fullmatch(first.message)
    assert m, first.message
    records, seen, peak, now, ratio, before = m.groups()
    v = climb[want - 1]
    assert int(records) == want and int(seen) == pre + want
    assert _close(peak, v) and _close(now, v) and _close(before, base) and _close(ratio, v / base, 3)
    assert first.details["ratio"] == v / base and first.details["baseline"] == base


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    start=st.floats(0.05, 20.0),
    n=st.integers(3, 30),
    fall=st.floats(0.005, 0.1),
    noise=st.floats(0.0, 0.15),
    hard=st.floats(1.0, 6.0),
    at=st.integers(1, 7),
)
def test_a_falling_or_wobbling_start_with_one_hard_batch_stays_quiet(seed, start, n, fall, noise, hard, at):
    """The loss falls 0.5-10% a record with up to 15% noise, and one record (a hard batch) stands
    up to 6x the curve within the first 8 records (later a smooth loss's 2x is a spike): no
    instability warning."""
    rng = random.Random(seed)
    losses = [start * (1 - fall) ** i * math.exp(noise * rng.uniform(-1, 1)) for i in range(n)]
    if at < n:
        losses[at] *= hard
    assert [a for a in loud(loss_records(losses, every=10)) if a.kind in INSTABILITY] == []


GRAD_MESSAGE = re.compile(
    r"grad_norm climbed (\d+) records in a row within its first (\d+), each above every earlier one, and stands "
    r"at (\S+): (\S+)x the highest before the climb \((\S+)\), while the loss stands (\S+)x its highest before "
    r"its own climb \((\S+)\); a start too short for a window"
)


def test_a_lora_grad_norm_60x_up_over_six_records_while_the_loss_doubles_warns():
    """From the first record: grad norm 0.27 -> 23 over six records, the loss 1.2 -> 2.4."""
    norms = [0.27, 0.6, 1.5, 4.0, 9.0, 17.0, 23.0, 21.0, 19.0]
    losses = [1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.4, 2.4]
    got = [a for a in loud(loss_records(losses, norms, every=10)) if a.kind is AlertKind.EXPLOSION]
    assert got and got[0].step == 30, [str(a) for a in got]
    m = GRAD_MESSAGE.fullmatch(got[0].message)
    assert m and m.groups() == ("3", "4", "4", "14.8", "0.27", "1.5", "1.2"), got[0].message


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    pre=st.integers(0, 4),
    g0=st.floats(1e-3, 1e3),
    grad_rate=st.floats(1.5, 4.0),
    loss_rate=st.floats(1.02, 1.3),
    length=st.integers(3, 6),
)
def test_a_gradient_climb_beside_a_climbing_loss_warns_with_true_numbers(seed, pre, g0, grad_rate, loss_rate, length):
    """`pre` falling records, then `length` records where the grad norm and the loss each climb
    (every record a new high of both): an explosion warning comes by the first record where the grad norm has climbed 3 records to 10x its highest earlier value and
    the loss 1.5x its own; when the climb rule says it, there and with the records' numbers."""
    rng = random.Random(seed)
    norms = sorted((g0 * math.exp(0.1 * rng.uniform(-1, 1)) for _ in range(pre + 1)), reverse=True)
    losses = [3.0 * 0.98**i for i in range(pre + 1)]
    gbase, lbase = norms[0], losses[0]
    norms += [gbase * grad_rate ** (k + 1) for k in range(length)]
    losses += [lbase * loss_rate ** (k + 1) for k in range(length)]
    want = next(
        (k for k in range(3, length + 1) if norms[pre + k] >= 10 * gbase and losses[pre + k] >= 1.5 * lbase),
        None,
    )
    found = [f for f in engine_alerts(loss_records(losses, norms)) if f.kind is AlertKind.EXPLOSION and not f.cleared]
    if want is None:
        assert [f for f in found if f.details.get("rule") == "early_climb"] == []
        return
    first = found[0]
    assert first.step <= pre + want
    if first.details.get("rule") != "early_climb":  # the jump rule saw it first (25x the median)
        return
    assert first.step == pre + want
    m = GRAD_MESSAGE.fullmatch(first.message)
    assert m, first.message
    records, seen, now, ratio, before, lratio, lbefore = m.groups()
    v, lv = norms[pre + want], losses[pre + want]
    assert int(records) == want and int(seen) == pre + 1 + want
    assert _close(now, v) and _close(before, gbase) and _close(ratio, v / gbase, 3)
    assert _close(lratio, lv / lbase, 3) and _close(lbefore, lbase)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(4, 12),
    g0=st.floats(1e-3, 1e3),
    up=st.floats(10.0, 200.0),
    wobble=st.floats(0.0, 0.1),
)
def test_a_warm_up_whose_grad_norm_climbs_under_a_level_loss_is_no_gradient_climb(seed, n, g0, up, wobble):
    """The gradient norm climbs 10-200x over the first records as the learning rate ramps up,
    while the loss stays within 10% of where it started: the climb rule stays quiet."""
    rng = random.Random(seed)
    norms = [g0 * up ** (i / (n - 1)) for i in range(n)]
    losses = [2.0 * math.exp(wobble * rng.uniform(-1, 1)) for _ in range(n)]
    found = [a for a in engine_alerts(loss_records(losses, norms)) if a.details.get("rule") == "early_climb"]
    assert found == []
