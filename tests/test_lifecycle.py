"""Alert lifecycle: dedup, cooldown, escalation, clearing."""
from nummon import AlertKind, Policy, Severity
from nummon._engine import AlertLifecycle, HealthEngine
from nummon._types import Finding, StepRecord

P = Policy.load("default")


def f(sev=Severity.WARNING, metric="grad_norm"):
    return Finding(AlertKind.EXPLOSION, sev, metric, 1.0, 1.0, "x")


def lifecycle_run(seq, policy=P):
    lc = AlertLifecycle(policy)
    eng = HealthEngine(policy)
    return [lc.update(step, fs, eng._make_alert) for step, fs in enumerate(seq)]


def test_one_alert_while_condition_holds_then_info_when_it_clears():
    out = lifecycle_run([[f()], [f()], [f()], []])
    assert [len(o) for o in out] == [1, 0, 0, 1]
    assert out[3][0].severity is Severity.INFO and out[3][0].cleared


def test_escalation_warning_to_critical_is_a_new_alert():
    out = lifecycle_run([[f()], [f(Severity.CRITICAL)], [f(Severity.CRITICAL)]])
    assert [a.severity for o in out for a in o] == [Severity.WARNING, Severity.CRITICAL]
    assert out[1][0].details["escalated_from"] == "warning"


def test_cooldown_suppresses_repeats_but_not_escalation():
    seq = [[f()], [], [f()], [], [f(Severity.CRITICAL)]]
    out = lifecycle_run(seq)
    sev = [[a.severity for a in o] for o in out]
    assert sev[0] == [Severity.WARNING]
    assert sev[2] == []  # same key within cooldown: quiet
    assert sev[3] == []  # a quiet condition clears quietly
    assert sev[4] == [Severity.CRITICAL]
    no_cd = Policy.model_validate({"alerts": {"cooldown_steps": 0}})
    out = lifecycle_run([[f()], [], [], [f()]], no_cd)
    assert [len(o) for o in out] == [1, 1, 0, 1]


def test_distinct_metrics_are_distinct_alerts():
    out = lifecycle_run([[f(metric="grad_norm"), f(metric="grad_max")]])
    assert len(out[0]) == 2


def test_nonfinite_record_does_not_clear_open_conditions():
    eng = HealthEngine(P)
    for i in range(10):
        eng.process(StepRecord(step=i, grad_norm=1.0))
    alerts, _ = eng.process(StepRecord(step=10, grad_norm=100.0))
    assert any(a.kind is AlertKind.EXPLOSION for a in alerts)
    alerts, health = eng.process(StepRecord(step=11, grad_norm=float("nan")))
    assert health.value == "nonfinite"
    assert not any(a.cleared for a in alerts)
