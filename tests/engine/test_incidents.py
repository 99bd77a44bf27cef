"""The run-level incident state machine: opened, escalated, lost, resolved; one event each."""

import math

from helpers.detector_tester import engine_steps, loss_records

from nummon import Alert, AlertKind, IncidentState, Severity
from nummon._core.alert_text import SUMMARY_MAX, TITLE_MAX
from nummon._engine.incidents import IncidentTracker

S = IncidentState


def alert(step, kind=AlertKind.RUNAWAY, sev=Severity.WARNING, metric="grad_norm", cleared=False, **kw):
    return Alert(step=step, kind=kind, severity=sev, message="m", metric=metric, cleared=cleared, **kw)


def test_open_escalate_lose_then_resolve_after_the_quiet_period():
    tr = IncidentTracker(quiet_steps=10)
    seen = []
    script = {
        3: [alert(3), alert(3, AlertKind.LOSS_SPIKE, metric="loss")],  # opened
        4: [alert(4, metric="param_norm")],  # more of the same: no event
        5: [
            alert(5, sev=Severity.CRITICAL, details={"growth": 300.0, "rate_per_step": 4.0, "steps_to_overflow": 52.0})
        ],
        6: [
            alert(
                6,
                AlertKind.NONFINITE,
                Severity.CRITICAL,
                metric="nonfinite",
                location="output of `fc2` (forward)",
                hint="use log_softmax",
                flight_record="runs/fr.json",
            )
        ],
        8: [
            alert(8, cleared=True),
            alert(8, metric="param_norm", cleared=True),
            alert(8, AlertKind.LOSS_SPIKE, metric="loss", cleared=True),
            alert(8, AlertKind.NONFINITE, metric="nonfinite", cleared=True, location="output of `fc2` (forward)"),
        ],
    }
    for step in range(30):
        seen += tr.update(step, script.get(step, []))
    assert [(e.step, e.previous, e.state) for e in seen] == [
        (3, S.NONE, S.OPEN),
        (5, S.OPEN, S.CRITICAL),
        (6, S.CRITICAL, S.NONFINITE),
        (18, S.NONFINITE, S.RESOLVED),
    ]
    lost = seen[2]
    assert lost.flight_record == "runs/fr.json" and lost.hint == "use log_softmax"
    assert lost.contributors[0].severity is Severity.CRITICAL and len(lost.contributors) == 4
    crit = next(c for c in seen[1].contributors if c.metric == "grad_norm")
    assert crit.rate_per_step == 4.0 and crit.steps_to_overflow == 52.0 and crit.growth == 300.0
    assert all(e.number == 1 and e.opened_step == 3 for e in seen)


def test_an_open_condition_keeps_the_incident_open_and_a_new_one_is_numbered():
    tr = IncidentTracker(quiet_steps=5)
    events = tr.update(0, [alert(0)])
    for step in range(1, 20):  # the condition never cleared
        events += tr.update(step, [])
    assert [e.state for e in events] == [S.OPEN]
    events += tr.update(20, [alert(20, cleared=True)])
    for step in range(21, 30):
        events += tr.update(step, [])
    assert events[-1].state is S.RESOLVED and events[-1].step == 25  # 5 quiet steps after the clear at 20
    events += tr.update(40, [alert(40, AlertKind.DIVERGENCE, Severity.CRITICAL, metric="loss")])
    assert events[-1].state is S.CRITICAL and events[-1].previous is S.RESOLVED and events[-1].number == 2
    assert [c.kind for c in events[-1].contributors] == [AlertKind.DIVERGENCE]


def test_info_alerts_do_not_open_an_incident():
    tr = IncidentTracker(quiet_steps=5)
    info = Alert(
        step=0, kind=AlertKind.NONFINITE, severity=Severity.INFO, message="scaler skipped", metric="scaled_gradients"
    )
    assert tr.update(0, [info]) == [] and tr.state is S.NONE


def test_title_and_summary_fit_wandb_limits_and_serialise():
    tr = IncidentTracker(quiet_steps=5)
    many = [
        alert(0, metric=f"layer_{i}_" + "x" * 60, location="l" * 80, value=1e30, rank=i, hint="h" * 300)
        for i in range(40)
    ]
    (ev,) = tr.update(0, many)
    assert len(ev.title) < 64 and ev.title.startswith("nummon: run unstable")
    text = ev.summary()
    assert len(text) <= SUMMARY_MAX < 1000 and "more" in text and text.count("\n- ") >= 2
    d = ev.to_dict()
    assert d["state"] == "open" and len(d["contributors"]) == 40 and d["title"] == ev.title
    long_title = IncidentTracker(5).update(0, [alert(0, metric="m" * 100)])[0].title
    assert len(long_title) <= TITLE_MAX


def test_engine_reports_incident_events_for_a_run_that_blows_up():
    """A runaway that goes non-finite: one event per transition, not one per alert."""
    values = [1.0] * 20 + [3.0**i for i in range(1, 12)] + [math.inf]
    steps = engine_steps(loss_records([1.0] * len(values), values))
    events = [e for got in steps for e in got.incidents]
    alerts = [a for got in steps for a in got.alerts]
    assert len(alerts) > len(events)
    assert [e.state for e in events] == [S.OPEN, S.CRITICAL, S.NONFINITE]
    lost = events[-1]
    assert lost.hint and "nonfinite" in lost.summary() and lost.title == "nummon: run lost: non-finite values"
