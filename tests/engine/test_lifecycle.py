"""Alert lifecycle: dedup, cooldown, escalation, clearing; transitions as data, alerts in one place."""

import math

from helpers.detector_tester import engine_steps, loss_records

from nummon import AlertKind, Health, Policy, Severity, StepRecord, load_policy
from nummon._core.types import Finding
from nummon._engine.engine import AlertLifecycle, HealthEngine, Transition

P = load_policy("default")


def f(sev=Severity.WARNING, metric="grad_norm"):
    return Finding(AlertKind.EXPLOSION, sev, metric, 1.0, 1.0, "x")


def alerts_of(seq, policy=P):
    """The alerts the engine builds from the lifecycle's transitions, per step."""
    lc = AlertLifecycle(policy.alerts)
    eng = HealthEngine(policy)
    return [[a for t in lc.update(step, fs) if (a := eng.alert_for(step, t))] for step, fs in enumerate(seq)]


def test_transitions_are_plain_data():
    lc = AlertLifecycle(P.alerts)
    assert lc.update(0, [f()]) == [Transition("opened", f())]
    assert lc.update(1, [f(Severity.CRITICAL)]) == [Transition("escalated", f(Severity.CRITICAL), Severity.WARNING)]
    assert lc.update(2, []) == [Transition("cleared", f(Severity.CRITICAL), Severity.CRITICAL)]


def test_one_alert_while_condition_holds_then_info_when_it_clears():
    out = alerts_of([[f()], [f()], [f()], []])
    assert [len(o) for o in out] == [1, 0, 0, 1]
    assert out[3][0].severity is Severity.INFO and out[3][0].cleared


def test_escalation_warning_to_critical_is_a_new_alert():
    out = alerts_of([[f()], [f(Severity.CRITICAL)], [f(Severity.CRITICAL)]])
    assert [a.severity for o in out for a in o] == [Severity.WARNING, Severity.CRITICAL]
    assert out[1][0].details["escalated_from"] == "warning"


def test_cooldown_suppresses_repeats_but_not_escalation():
    seq = [[f()], [], [f()], [], [f(Severity.CRITICAL)]]
    sev = [[a.severity for a in o] for o in alerts_of(seq)]
    assert sev[0] == [Severity.WARNING]
    assert sev[2] == []  # same key within cooldown: quiet
    assert sev[3] == []  # a quiet condition clears quietly
    assert sev[4] == [Severity.CRITICAL]
    no_cd = Policy.model_validate({"alerts": {"cooldown_steps": 0}})
    assert [len(o) for o in alerts_of([[f()], [], [], [f()]], no_cd)] == [1, 1, 0, 1]


def test_recurring_nonfinite_alerts_again_after_the_cooldown():
    """NaN at steps 5, 10, 24 and 30: a quiet stretch does not restart the cooldown (that gave one
    critical alert for all four); the condition of steps 5 and 10 clears after 10 finite records
    (step 20), so the NaN at 24 is a new alert; 30 comes back within its cooldown."""
    eng = HealthEngine(P)
    crit = []
    for step in range(40):
        loss = math.nan if step in (5, 10, 24, 30) else 1.0
        alerts = eng.step(StepRecord(step=step, loss=loss)).alerts
        crit += [a.step for a in alerts if a.severity is Severity.CRITICAL]
    assert crit == [5, 24]


def test_a_condition_held_silently_is_announced_once_the_cooldown_is_over():
    seq = [[f()], []] + [[f()]] * 30
    steps = [i for i, o in enumerate(alerts_of(seq)) for a in o if a.severity is Severity.WARNING]
    assert steps == [0, 21]


def test_distinct_metrics_are_distinct_alerts():
    out = alerts_of([[f(metric="grad_norm"), f(metric="grad_max")]])
    assert len(out[0]) == 2


def test_nonfinite_record_does_not_clear_open_conditions():
    eng = HealthEngine(P)
    for i in range(10):
        eng.step(StepRecord(step=i, grad_norm=1.0))
    alerts = eng.step(StepRecord(step=10, grad_norm=100.0)).alerts
    assert any(a.kind is AlertKind.EXPLOSION for a in alerts)
    got = eng.step(StepRecord(step=11, grad_norm=float("nan")))
    alerts, health = got.alerts, got.health
    assert health is Health.NONFINITE
    assert not any(a.cleared for a in alerts)


def test_a_record_without_the_metric_neither_opens_nor_clears_its_condition():
    """A Hugging Face eval row (no `loss`) does not clear an active divergence alert."""
    eng = HealthEngine(P)
    got = []
    for i in range(30):
        loss = 2.0 if i < 10 else 1.5e7
        got += eng.step(StepRecord(step=2 * i, loss=loss)).alerts
    assert any(a.kind is AlertKind.DIVERGENCE and not a.cleared for a in got)
    got = eng.step(StepRecord(step=61, lr=1e-4))  # an eval-only row: no loss
    eval_row, health = got.alerts, got.health
    assert not any(a.cleared for a in eval_row) and health is Health.INCIDENT
    nxt = eng.step(StepRecord(step=62, loss=1.5e7)).alerts
    assert nxt == ()  # still the same open condition: no new alert either


def test_health_is_extreme_only_for_headroom_and_incident_while_one_is_open():
    eng = HealthEngine(P)
    healths = [eng.step(StepRecord(step=i, grad_norm=1.0)).health for i in range(10)]
    assert set(healths) == {Health.HEALTHY}
    h = eng.step(StepRecord(step=10, grad_norm=100.0)).health  # an explosion: finite, 36 decades left
    assert h is Health.INCIDENT
    h = eng.step(StepRecord(step=11, grad_norm=1e35)).health  # 3.5 decades of float32 left
    assert h is Health.EXTREME


def _clears(records):
    """(step, alert) of each "cleared" alert over the records."""
    return [(rec.step, a) for rec, got in zip(records, engine_steps(records)) for a in got.alerts if a.cleared]


def test_a_runaway_does_not_clear_while_its_metric_is_still_far_above_its_level():
    """The loss pauses (200 -> 207) on its way to NaN: no "back within limits" for it."""
    losses = [2.0 + 0.01 * (i % 3) for i in range(20)] + [20.0, 200.0, 207.0, 482.0, 5140.0, float("nan")]
    clears = _clears(loss_records(losses))
    assert not [a for _, a in clears if a.metric == "loss"], [str(a) for _, a in clears]


def test_an_explosion_clears_only_back_near_its_pre_spike_level():
    """grad_norm ~1, one jump to 50, then 20 for 14 steps (the spike's values become the median of
    a short history): still open; it clears when the norm is back near 1."""
    norms = [1.0 + 0.02 * (i % 4) for i in range(8)] + [50.0] + [20.0] * 14 + [1.1] * 5
    clears = _clears(loss_records([1.0 + 0.05 * (i % 3) for i in range(len(norms))], norms))
    grad = [step for step, a in clears if a.metric == "grad_norm"]
    assert grad and min(grad) >= 23, [(s, str(a)) for s, a in clears]
