"""The countdown of runaway alerts: steps left before overflow that never promise time that is not there."""

import math

from helpers.checkout import CORPUS, DATA
from helpers.detector_tester import engine_alerts, loss_records
from hypothesis import given
from hypothesis import strategies as st

from nummon import Severity, load_policy, read_trace
from nummon._engine.detectors.countdown import countdown
from nummon._engine.engine import HealthEngine

F32_DECADES = math.log10(3.4028234663852886e38)


def first_critical_countdown(records):
    """(alert, real steps left) of the first critical alert with a countdown, in a run that goes non-finite."""
    engine = HealthEngine(load_policy("default"))
    alert = None
    for rec in records:
        got = engine.step(rec)
        for a in got.alerts:
            if alert is None and a.severity is Severity.CRITICAL and "steps_to_overflow" in a.details:
                alert = a
        if alert is not None and not rec.is_finite():
            return alert, rec.step - alert.step
    return None, None


def within(alert, left):
    return 1 <= alert.details["steps_to_overflow"] <= 1.5 * left + 2


def test_the_readme_table_gets_an_honest_countdown():
    """Critical at step 44, NaN at 46: the alert said ~18 steps; it may say at most 5."""
    alert, left = first_critical_countdown(read_trace(DATA / "batch39_46.jsonl"))
    assert alert.step == 44 and left == 2
    assert within(alert, left), alert.message
    # 0.5 decades/step, then bursts: no steady rate and no measured rise; the early end heads
    assert "~2-20 steps left until float32 overflow (~20 at today's rate, ~2 if" in alert.message, alert.message
    assert "rising" not in alert.message and alert.details["steps_to_overflow_range"] == [2.0, 20.0]


def test_every_runaway_of_the_dev_corpus_gets_an_honest_countdown():
    checked = 0
    for path in sorted(CORPUS.glob("*.jsonl")):
        alert, left = first_critical_countdown(read_trace(path))
        if alert is not None:
            checked += 1
            assert within(alert, left), (path.name, alert.message, left)
    assert checked >= 8


def test_a_sparse_log_counts_records_and_steps():
    """One record every 10 steps: "x571 over one record (10 steps)", never "10 consecutive steps"."""
    losses = [2.0, 1.9, 1.8, 1.85, 1.7, 1.75, 1.7, 1.65, 1.6, 1.62, 1.6, 1.58, 40.0, 2.3e4, 1.3e7]
    runaway = [a for a in engine_alerts(loss_records(losses, every=10)) if a.kind.value == "runaway"]
    assert runaway, "no runaway alert"
    texts = " | ".join(a.message for a in runaway)
    assert "consecutive steps" not in texts, texts
    assert "over one record (10 steps)" in texts or "records (" in texts, texts
    assert "record" in texts.split("left")[0] and "(~" in texts, texts  # the countdown in records too


@given(st.lists(st.floats(0.05, 12.0), min_size=1, max_size=6), st.floats(-3.0, 30.0), st.integers(1, 50))
def test_the_countdown_is_never_below_one_step_and_never_beyond_the_flat_rate(increments, start, spacing):
    points, level = [(0, start)], start
    for k, inc in enumerate(increments, 1):
        level += inc * spacing
        points.append((k * spacing, level))
    c = countdown(points, F32_DECADES)
    assert c.steps >= 1
    if c.at_rate is not None:
        assert c.steps <= c.at_rate  # acceleration can only shorten it
    text = c.phrase("float32")
    assert "~1 steps" not in text and "~1 records" not in text


def test_a_rising_rate_says_at_most_only_when_measured():
    quad = countdown([(t, 0.1 * t * t) for t in range(6)], F32_DECADES)
    assert quad.rising and quad.phrase("float32").startswith("at most ~")
    steady = countdown([(0, 0.0), (1, 2.0), (2, 4.0), (3, 6.0)], F32_DECADES)
    assert (
        not steady.rising
        and steady.phrase("float32") == "~17 steps left until float32 overflow at today's rate (steady)"
    )
    one_jump = countdown([(0, 0.0), (1, 0.5), (2, 1.0), (3, 3.0)], F32_DECADES)  # one pair of increments rises
    assert not one_jump.rising and "rising" not in one_jump.phrase("float32") and "(~" in one_jump.phrase("float32")


def test_a_single_jump_assumes_no_acceleration():
    """A spike of one or two records (the demo's step 60) is not yet a sustained runaway: the flat rate heads."""
    c = countdown([(58, -1.29), (59, -0.64), (60, 1.68)], F32_DECADES)
    assert c.steps == c.at_rate and not c.rising
    # the range is said, today's rate at its far end: "~2-25 steps left ... (~25 at today's rate, ..."
    assert c.phrase("float32").startswith(f"~{round(c.range[0])}-{round(c.steps)} steps left until float32 overflow (~")


def test_a_rate_that_slowed_over_four_points_promises_no_floor():
    """The demo's loss at step 46 (1.7, 18.6, 104, 220 after a flat start: 11x, 5.6x, 2.1x) was
    said to have "at least ~212 steps" left; it grew 6.7x at the next step and overflowed 5 steps
    later. Four points do not measure a falling rate: the range is said, and it holds the truth."""
    from nummon import Contributor

    losses = [2.3, 2.1, 2.2, 2.0, 1.9, 2.0, 1.8, 1.9, 1.7, 1.8, 1.6, 1.7, 1.675, 18.59, 103.7, 220.1]
    said = engine_alerts(loss_records(losses))
    (runaway,) = [a for a in said if a.kind.value == "runaway" and a.step == len(losses) - 1][-1:]
    assert "at least" not in runaway.message and "falling" not in runaway.message, runaway.message
    low, high = runaway.details["steps_to_overflow_range"]
    assert low <= 5 <= high and runaway.details["steps_to_overflow"] == low, runaway.message
    # the incident's bullet says the range too, not the headline alone
    line = Contributor.from_alert(runaway).line()
    assert f", ~{round(low)}-{round(high)} steps to overflow)" in line, line
    assert Contributor.from_alert(runaway).to_dict()["steps_to_overflow_range"] == [low, high]
    rising = countdown([(t, 0.1 * t * t) for t in range(6)], F32_DECADES)
    assert rising.rising  # and its bullet says "at most", as before


def test_a_rate_measured_to_fall_heads_with_the_streaks_rate_not_a_floor():
    """Six points of a steadily slowing growth: "falling" is said, with the flat figure of the
    line over the streak (sooner than the fit's slowed slope now would say), and no "at least"."""
    pts = [(t, 3.0 * t - 0.12 * t * t) for t in range(6)]
    c = countdown(pts, F32_DECADES)
    assert c.trend == "falling" and c.steps == c.at_rate
    slope_now = 3.0 - 0.24 * 5
    assert c.steps < (F32_DECADES - pts[-1][1]) / slope_now
    assert "at least" not in c.phrase("float32") and "(the growth rate is falling)" in c.phrase("float32")


def test_an_incident_bullet_with_a_range_names_its_location_once():
    """The bullet's range is its own text: the location it adds is still judged against the value's."""
    from nummon import AlertKind, Contributor, Severity

    c = Contributor(
        step=43,
        kind=AlertKind.RUNAWAY,
        severity=Severity.WARNING,
        metric="activation_max",
        value=317.1,
        rate_per_step=4.04,
        steps_to_overflow=5.0,
        location="fc1",
        steps_to_overflow_range=(5.0, 60.0),
        value_text="activation_max 317.1 at fc1",
    )
    line = c.line()
    assert "~5-60 steps to overflow" in line and line.count("fc1") == 1, line
