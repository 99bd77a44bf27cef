"""Baselines and windows on runs shaped like the real logs of tests/data/real (coarse logging, early
blow-ups, slow fine-tunes, long stalls, plateaus), each judged through the whole engine."""

import math
import random

from helpers.detector_tester import DEFAULT_POLICY as P
from helpers.detector_tester import loss_records_at, loud

from nummon import AlertKind, StepRecord
from nummon._engine.engine import HealthEngine


def test_a_loss_climbing_from_its_first_record_is_warned_at_once():
    """QLoRA log: 1.0 -> 4.3 -> 8.8 -> 13.5 -> ... -> 29.6 over its first ten records (every 10
    steps) got no warning: the starting level waited for ten records."""
    losses = [1.0, 4.3, 8.8, 13.5, 17.2, 20.1, 22.8, 25.3, 27.6, 29.6]
    got = loud(loss_records_at([(10 * (i + 1), v) for i, v in enumerate(losses)]))
    assert any(a.kind in (AlertKind.DIVERGENCE, AlertKind.RUNAWAY) for a in got)
    assert min(a.step for a in got) <= 70


def test_a_run_that_blows_up_within_its_first_records_is_judged_against_its_start():
    """lr 3: the loss sat at 20-200 (start 4.2) for 190 steps: the median of the first ten losses
    already held the blow-up, so the run stayed `healthy`."""
    rnd = random.Random(3)
    losses = [4.2, 9.0, 31.0] + [10 ** rnd.uniform(math.log10(20), math.log10(200)) for _ in range(190)]
    got = loud(loss_records_at(enumerate(losses)))
    div = [a for a in got if a.kind is AlertKind.DIVERGENCE]
    assert div and div[0].step <= 15


def test_a_slow_healthy_fine_tune_is_not_a_stall():
    """LoRA log: loss falls slowly 1.37 -> 0.70 over 730 steps, logged every 10: five false
    stall warnings from a 100-step window."""
    rnd = random.Random(1)
    pts = [(s, (0.55 + 0.82 * math.exp(-s / 420)) * (1 + 0.02 * rnd.uniform(-1, 1))) for s in range(10, 740, 10)]
    assert 0.66 < pts[-1][1] < 0.75 and 1.3 < pts[0][1] < 1.4
    assert loud(loss_records_at(pts)) == []


def test_a_long_stall_at_chance_logged_every_50_steps_is_found():
    """Multiple-choice fine-tune at ln 4 for 3,000 steps, logged every 50: a 100-step window
    never held the ten records it needs."""
    rnd = random.Random(2)
    pts = [(s, math.log(4) + 0.01 * rnd.uniform(-1, 1)) for s in range(50, 3050, 50)]
    got = loud(loss_records_at(pts))
    assert any(a.kind is AlertKind.STALL for a in got)


def test_an_early_pretraining_plateau_is_not_a_stall():
    """GPT-2 124M: 11 -> 6.3 in 100 steps, then a plateau near 6.3: a stall warning at step 209
    was a false alarm. The window spans the whole run so far, so a plateau counts as a stall
    only once it is most of the run (here from step ~380, nearly 3x the descent)."""
    rnd = random.Random(4)

    def loss(s):
        if s < 100:
            return 11.0 - 4.7 * s / 100
        if s < 400:
            return 6.3
        return 6.3 * math.exp(-(s - 400) / 800)

    pts = [(s, loss(s) * (1 + 0.01 * rnd.uniform(-1, 1))) for s in range(0, 1500)]
    assert [a for a in loud(loss_records_at(pts)) if a.step <= 300] == []


def test_epoch_steps_with_flat_epochs_are_neither_stall_nor_oscillation():
    """Per-batch log of a multi-epoch fine-tune: learning in the first epoch, then flat within
    each epoch with a step down at each epoch boundary."""
    rnd = random.Random(5)
    first = [1.8 + 0.8 * math.exp(-i / 30) for i in range(120)]
    later = [lv for lv in (1.5, 1.25, 1.05, 0.92) for _ in range(120)]
    pts = [(s, v * (1 + 0.08 * rnd.uniform(-1, 1))) for s, v in enumerate(first + later)]
    assert [a for a in loud(loss_records_at(pts)) if a.kind in (AlertKind.STALL, AlertKind.OSCILLATION)] == []


def test_the_trend_window_is_computed_once_per_record_for_both_of_its_readers():
    eng = HealthEngine(P)
    trend = next(d for d in eng.detectors if d.section == "stall")._trend
    assert next(d for d in eng.detectors if d.section == "oscillation")._trend is trend
    for s in range(5):
        eng.step(StepRecord(step=s, loss=1.0))
    assert trend._records == 5  # two readers, one update per record


def test_the_trend_window_keeps_bounded_memory_over_a_long_run():
    eng = HealthEngine(P)
    trend = next(d for d in eng.detectors if d.section == "stall")._trend
    stalls = []
    for s in range(10_000):
        stalls += [
            a for a in eng.step(StepRecord(step=s, loss=2.0 + 0.01 * (s % 7))).alerts if a.kind is AlertKind.STALL
        ]
    assert len(trend._values) <= trend.MAX_POINTS and trend._stride > 1
    assert stalls, "still judged after thinning"
