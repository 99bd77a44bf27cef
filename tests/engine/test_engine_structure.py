"""The shape of the detection core: one segmented engine serves replay and watch (restarts in
one place), and the engine owns every decision (the Monitor is wiring, recovery builds no alert)."""

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon import StepRecord, load_policy, replay
from nummon._engine.engine import HealthEngine
from nummon._engine.outcome import FlightRecordRef, StepEvidence
from nummon._engine.segments import SegmentedEngine
from nummon._tools.replay import iter_replay_records
from nummon._watch.runs import WatchedRun

POLICY = load_policy("default")


def _segment(n, start, base, spike_at):
    """One run's records: a noisy loss and grad norm, a spike (or a NaN) at `spike_at`."""
    out = []
    for i in range(n):
        g, loss = base * (1.0 + 0.1 * math.sin(i)), 2.0 / (1 + 0.01 * i)
        if i == spike_at:
            g, loss = (float("nan"), float("nan")) if base > 2 else (g * 1e4, loss)
        out.append({"step": start + i, "loss": loss, "grad_norm": g})
    return out


segments = st.lists(
    st.tuples(st.integers(5, 60), st.integers(0, 30), st.floats(0.5, 4.0), st.integers(0, 70)),
    min_size=1,
    max_size=4,
)


def _key(alerts):
    return [(a.step, a.kind, a.severity, a.message, a.cleared) for a in alerts]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(segments)
def test_a_trace_with_restarts_replays_as_its_segments_alone(tmp_path, segs):
    """Replay, the records path and a watched run all give, for a trace whose steps start over,
    exactly the alerts of each segment replayed in a fresh engine of its own."""
    rows = [_segment(*s) for s in segs]
    alone = []
    for seg in rows:
        engine = HealthEngine(POLICY)
        for o in seg:
            alone.extend(engine.step(StepRecord.from_dict(o, "t", 0)).alerts)
    flat = [o for seg in rows for o in seg]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(o) + "\n" for o in flat))
    warned = []
    assert _key(replay(trace, POLICY, warn=warned.append)) == _key(alone)
    assert _key(iter_replay_records([StepRecord.from_dict(o, "t", 0) for o in flat], POLICY)) == _key(alone)
    restarts = sum(1 for a, b in zip(flat, flat[1:]) if b["step"] <= a["step"])
    assert sum("a new segment" in w for w in warned) == restarts

    run, seen = WatchedRun("r", None, POLICY), []
    run.on_record = lambda _id, rec, got: seen.extend(got.alerts)
    for o in flat:
        run.process(StepRecord.from_dict(o, "t", 0))
    assert _key(seen) == _key(alone)
    assert run.segments == restarts and len(run.notes) == restarts


def test_incident_numbers_go_on_across_segments():
    """A fresh segment's incidents number on from the last one's (no event id repeats)."""
    seg = SegmentedEngine(POLICY)
    numbers = []
    for start in (0, 0):
        for o in _segment(40, start, 3.0, 20):
            numbers.extend(ev.number for ev in seg.step(StepRecord.from_dict(o, "t", 0)).incidents)
    assert seg.segments == 1 and numbers and numbers == sorted(numbers) and numbers[-1] == 2


ROOT = Path(__file__).resolve().parents[2]


def _engine_members_used(path):
    """The attributes the module reads off an `engine` attribute (the Monitor's HealthEngine)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            used.add(node.attr)
    return used


def test_the_monitor_touches_the_health_engine_through_three_members():
    """step (judge the record), finish (the outcome) and close (the run's end); beyond those only
    its state is carried (a checkpoint): every other decision is the engine's."""
    folder = ROOT / "nummon" / "_monitor"
    assert _engine_members_used(folder / "pipeline.py") == {"step", "finish", "close"}
    assert _engine_members_used(folder / "monitor.py") == {"state_dict", "load_state_dict"}


def _alerts_built(path):
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Alert"
    ]


def test_recovery_forensics_and_replicas_build_no_alert():
    """Recovery reports what it did, forensics and replica checks what they found: the engine
    side (nummon/_engine/engine.py, nummon/_engine/outcome.py) builds every alert."""
    for rel in (
        "_monitor/recovery/_recovery.py",
        "_forensics/verdict.py",
        "_forensics/_alerts.py",
        "_forensics/replicas.py",
        "_monitor/monitor.py",
        "_monitor/pipeline.py",
    ):
        assert _alerts_built(ROOT / "nummon" / rel) == [], rel
    assert _alerts_built(ROOT / "nummon" / "_engine" / "outcome.py")


def test_the_outcome_is_immutable():
    engine = HealthEngine(POLICY)
    rec = StepRecord.from_dict({"step": 0, "loss": float("nan")}, "t", 0)
    got = engine.step(rec)
    outcome = engine.finish(got, StepEvidence(rec))
    assert outcome.alerts and outcome.critical and outcome.stop
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.stop = False


def test_the_evidence_is_plain_data_and_the_outcome_names_the_files_due():
    """The engine writes no file: the evidence carries no function, and the outcome says which
    files are due (the run's first flight record, the report); the caller records their paths."""
    assert not any("Callable" in str(f.type) for f in dataclasses.fields(StepEvidence))
    engine = HealthEngine(POLICY)
    rec = StepRecord.from_dict({"step": 0, "loss": float("nan")}, "t", 0)
    outcome = engine.finish(engine.step(rec), StepEvidence(rec))
    critical = [i for i, a in enumerate(outcome.alerts) if a.severity.value == "critical"]
    assert [d.index for d in outcome.flight_record_due] == critical and outcome.report_due
    assert outcome.flight_record is None and not any(a.flight_record for a in outcome.alerts)
    done = outcome.with_flight_record(outcome.flight_record_due[0], FlightRecordRef("fr.json", [0], []))
    done = done.with_report("report.html")
    assert done.flight_record == "fr.json" and done.alerts[critical[0]].flight_record == "fr.json"
    assert done.incidents and all(e.flight_record == "fr.json" and e.report == "report.html" for e in done.incidents)
    assert not done.flight_record_due and not done.report_due
    nxt = StepRecord.from_dict({"step": 1, "loss": float("nan")}, "t", 1)
    later = engine.finish(engine.step(nxt), StepEvidence(nxt, flight_record="fr.json"))
    assert not later.flight_record_due  # the run has its flight record already
