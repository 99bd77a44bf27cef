"""The health engine owns its state: one entry point, rebaseline, mark_acted, state_dict; records
are frozen once it has seen them."""

import dataclasses
import json

import pytest

from nummon import Alert, AlertKind, Health, IncidentState, Severity, StateError, StepRecord, load_policy
from nummon._engine.engine import HealthEngine

POLICY = load_policy("default")
RUNAWAY = [2.0] * 12 + [2.0 * 8**k for k in range(1, 5)]  # a critical runaway, still finite


def run(engine, losses, start=0):
    return [engine.step(StepRecord(step=start + i, loss=v, grad_norm=1.0)) for i, v in enumerate(losses)]


def test_a_restored_engine_continues_where_the_saved_one_was():
    saved = HealthEngine(POLICY)
    run(saved, RUNAWAY)
    assert saved.incident_state is IncidentState.CRITICAL
    state = json.loads(json.dumps(saved.state_dict(), allow_nan=False))  # plain strict-JSON data
    resumed = HealthEngine(POLICY)
    resumed.load_state_dict(state)
    assert resumed.incident_state is IncidentState.CRITICAL
    assert resumed.current_incident(len(RUNAWAY)).contributors  # who made it critical came back too
    # warm: the same next record gets the same verdict from both, and no alert is repeated
    nxt = StepRecord(step=len(RUNAWAY), loss=2.0 * 8**5, grad_norm=1.0)
    a, b = saved.step(nxt), resumed.step(dataclasses.replace(nxt))
    assert (a.health, [x.key for x in a.alerts]) == (b.health, [x.key for x in b.alerts])
    cold = HealthEngine(POLICY).step(dataclasses.replace(nxt))
    assert cold.health is Health.HEALTHY and b.health is not Health.HEALTHY  # the saved state mattered


@pytest.mark.parametrize(
    "bad", [{"incident": "abc"}, {"first": [{"step": "x"}]}, {"history": 3}, {"incident": {"state": "on fire"}}]
)
def test_a_bad_saved_state_is_a_one_line_state_error_and_changes_nothing(bad):
    engine = HealthEngine(POLICY)
    run(engine, RUNAWAY)
    before = engine.state_dict()
    with pytest.raises(StateError) as err:
        engine.load_state_dict(bad)
    assert "\n" not in str(err.value)
    assert engine.state_dict() == before


def test_rebaseline_starts_the_detectors_afresh_and_keeps_the_incident():
    engine = HealthEngine(POLICY)
    run(engine, RUNAWAY)
    old = list(engine.detectors)
    engine.rebaseline()
    assert engine.incident_state is IncidentState.CRITICAL
    assert not any(d in old for d in engine.detectors) and len(engine.detectors) == len(old)
    assert engine.state_dict()["first"] == [] and engine.state_dict()["history"] == []


def test_mark_acted_is_one_event_naming_the_action():
    engine = HealthEngine(POLICY)
    alert = Alert(
        step=3,
        kind=AlertKind.RUNAWAY,
        severity=Severity.WARNING,
        metric="recovery",
        message="recovered: rolled back to step 0",
    )
    ev = engine.mark_acted(alert)
    assert ev.action == "recovered: rolled back to step 0" and engine.incident_state is IncidentState.OPEN


def test_a_record_is_frozen_once_the_engine_has_seen_it():
    rec = StepRecord(step=0, loss=1.0)
    rec.loss = 2.0  # still being built: fine
    HealthEngine(POLICY).step(rec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.clip_ratio = 0.5
    assert dataclasses.replace(rec, clip_ratio=0.5).clip_ratio == 0.5 and rec.clip_ratio is None
    assert not hasattr(HealthEngine, "process")  # one entry point


class CountingEngine(HealthEngine):
    """A real engine that counts the records its detectors run over."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.updates = 0

    def step(self, rec):
        self.updates += 1
        return super().step(rec)


def test_a_huge_saved_history_rewarms_from_its_tail_only():
    # 60,000 saved records (a state written by hand or by a bigger engine): only the records this
    # engine keeps run through the detectors, the last ones
    history = [{"step": i, "loss": 2.0, "grad_norm": 1.0} for i in range(60_000)]
    first = [{"step": i, "loss": 2.0, "grad_norm": 1.0} for i in range(100)]
    engine = CountingEngine(POLICY)
    engine.load_state_dict({"incident": {}, "first": first, "history": history})
    assert engine.updates == 32 + 256
    kept = engine.state_dict()["history"]
    assert [r["step"] for r in kept] == list(range(60_000 - 256, 60_000))
