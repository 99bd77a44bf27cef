"""Each detector on traces made to trigger it and on traces that must not, plus properties."""

import math
from collections import deque

import pytest
from helpers.detector_tester import detector_findings, make_detector
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import AlertKind, Policy, Severity, StepRecord, load_policy
from nummon._engine.detectors import (
    DETECTORS,
    DivergenceDetector,
    HeadroomDetector,
    NonfiniteDetector,
    OscillationDetector,
    RunawayDetector,
    SpikeDetector,
    StallDetector,
    VanishingDetector,
    build_detectors,
    shared_values,
)
from nummon._engine.engine import HealthEngine

P = load_policy("default")


def test_nonfinite_first_location_sticks_while_condition_holds():
    det = make_detector(NonfiniteDetector)
    assert det.update(StepRecord(step=0, loss=1.0)) == []
    f = det.update(
        StepRecord(
            step=1, loss=math.nan, nonfinite_parts=("activations",), nonfinite_location="output of `fc2` (forward)"
        )
    )
    assert f[0].severity is Severity.CRITICAL and f[0].location == "output of `fc2` (forward)"
    f2 = det.update(
        StepRecord(
            step=2, loss=math.nan, nonfinite_parts=("activations",), nonfinite_location="output of `conv1` (forward)"
        )
    )
    assert f2[0].location == "output of `fc2` (forward)"  # still the first one
    assert det.update(StepRecord(step=3, loss=1.0)) == []


def test_nonfinite_input_is_named_as_input():
    f = make_detector(NonfiniteDetector).update(StepRecord(step=0, loss=1.0, input_nonfinite=3))
    assert f[0].location == "input batch" and f[0].metric == "input"


def test_spike_is_relative_to_the_runs_own_scale():
    # the same relative jump fires at scale 1e-3 and at scale 1e3; a fixed "> 100" rule could not
    for scale in (1e-3, 1.0, 1e3):
        vals = [scale * (1 + 0.1 * (i % 3)) for i in range(30)] + [scale * 50]
        found = detector_findings(make_detector(SpikeDetector), vals, "grad_norm")
        assert not any(found[:-1])
        assert found[-1][0].kind is AlertKind.EXPLOSION and found[-1][0].severity is Severity.WARNING


def test_loss_spike_kind_and_no_alarm_for_noise():
    vals = [2.0 + 0.3 * math.sin(i) for i in range(60)]
    assert not any(detector_findings(make_detector(SpikeDetector), vals))
    found = detector_findings(make_detector(SpikeDetector), vals + [40.0])
    assert found[-1][0].kind is AlertKind.LOSS_SPIKE


def test_spike_baseline_not_poisoned_by_nan_or_by_the_spike():
    det = make_detector(SpikeDetector)
    vals = [1.0] * 20 + [math.nan, math.inf, 1e6] + [1.0] * 5 + [30.0]
    found = detector_findings(det, vals, "grad_norm")
    assert found[22] and found[-1], "the spike after NaN/Inf and a spike is still judged against ~1.0"
    assert not any(found[23:-1])


def test_runaway_critical_with_steps_to_overflow():
    vals = [1.0] * 10 + [3.0, 20.0, 300.0, 9000.0]
    found = detector_findings(make_detector(RunawayDetector), vals, "grad_norm")
    sev = [max((f.severity.rank for f in fs), default=-1) for fs in found]
    assert sev[11] == Severity.WARNING.rank and sev[12] == Severity.CRITICAL.rank
    crit = found[12][0]
    assert 0 < crit.details["steps_to_overflow"] < 60 and "overflow" in crit.message


def test_runaway_handles_step_gaps_and_ignores_slow_growth():
    recs = [StepRecord(step=s, loss=v) for s, v in [(0, 1.0), (10, 2.0), (20, 4.0), (30, 8.0), (40, 16.0)]]
    det = make_detector(RunawayDetector)
    assert not any(det.update(r) for r in recs), "2x per 10 steps is not runaway growth"
    slow = [1.05**i for i in range(200)]
    assert not any(detector_findings(make_detector(RunawayDetector), slow, "param_norm"))


def test_headroom_per_dtype():
    det = make_detector(HeadroomDetector)
    assert det.update(StepRecord(step=0, grad_max=1e3)) == []
    w = det.update(StepRecord(step=1, grad_max=1e30))
    assert w[0].kind is AlertKind.EXTREME and w[0].severity is Severity.WARNING
    c = det.update(StepRecord(step=2, grad_max=1e36))
    assert c[0].severity is Severity.CRITICAL
    half = det.update(StepRecord(step=3, headroom=0.2, headroom_dtype="float16"))
    assert half[0].severity is Severity.CRITICAL and half[0].details["dtype"] == "float16"


def test_divergence_judges_the_median_of_the_last_patience_records():
    # two records above 10x of a 5-record window are a blip; a majority above is divergence,
    # and a single dip below does not reset it
    vals = [2.0] * 10 + [50.0] * 2 + [2.0] * 5 + [50.0, 50.0, 50.0, 1.0, 50.0, 50.0]
    found = detector_findings(make_detector(DivergenceDetector), vals)
    assert not any(found[:19]) and found[19][0].kind is AlertKind.DIVERGENCE
    assert all(found[19:]), "the dip at record 20 does not clear it"


def test_stall_flat_high_loss_but_not_converged_run():
    flat = [2.3 + 0.01 * math.sin(i) for i in range(150)]
    assert any(detector_findings(make_detector(StallDetector), flat))
    converged = [2.3 * math.exp(-i / 20) + 0.01 for i in range(300)]
    assert not any(detector_findings(make_detector(StallDetector), converged))


def test_oscillation_bouncing_but_not_minibatch_noise():
    bouncing = [1.5 + 0.8 * ((-1) ** i) * (1 + 0.3 * math.sin(i / 7)) for i in range(150)]
    bouncing = [2.3] * 10 + bouncing
    assert any(
        f and f[0].kind is AlertKind.OSCILLATION
        for f in detector_findings(make_detector(OscillationDetector), bouncing)
    )
    import random

    rnd = random.Random(0)
    healthy = [2.3 * math.exp(-i / 40) * (1 + 0.5 * rnd.random()) for i in range(336)]
    assert not any(detector_findings(make_detector(OscillationDetector), healthy))


def test_vanishing_layer_among_live_ones():
    det = make_detector(VanishingDetector)
    found = []
    for i in range(65):  # b learns for 5 steps, then its gradient is gone
        found.append(
            det.update(StepRecord(step=i, layer_grad_norms={"a.weight": 1.0, "b.weight": 0.5 if i < 5 else 0.0}))
        )
    assert not any(found[:54]) and "b.weight" in found[54][0].message
    assert found[54][0].details["layers"] == {"b.weight": 0.0}


def test_vanished_layers_of_one_step_are_one_finding_naming_the_worst():
    det = make_detector(VanishingDetector)
    norms = {"live.weight": 1.0, **{f"l{i}.weight": i * 1e-9 for i in range(15)}}
    det.update(StepRecord(step=0, layer_grad_norms=dict.fromkeys(norms, 1.0)))  # every layer learned once
    for i in range(1, 51):
        found = det.update(StepRecord(step=i, layer_grad_norms=norms))
    assert len(found) == 1
    f = found[0]
    assert f.details["count"] == 15 and list(f.details["layers"]) == ["l0.weight", "l1.weight", "l2.weight"]
    assert "15 layers" in f.message and "and 12 more" in f.message


# ------------------------------------------------------------------ properties

finite = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)
anyfloat = st.floats(allow_nan=True, allow_infinity=True)
FIELDS = ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max", "update_ratio", "lr")


def records(values_strategy):
    return st.lists(
        st.fixed_dictionaries({f: st.one_of(st.none(), values_strategy) for f in FIELDS}), min_size=1, max_size=150
    )


@settings(max_examples=60, deadline=None)
@given(records(finite))
def test_any_finite_trace_never_crashes_any_detector(rows):
    dets = build_detectors(P)
    assert len(dets) == len(DETECTORS)
    for i, row in enumerate(rows):
        rec = StepRecord(step=i, **row)
        for d in dets:
            for f in d.update(rec):
                assert f.kind in d.kinds
                assert isinstance(f.message, str) and f.message


@settings(max_examples=60, deadline=None)
@given(records(anyfloat), st.integers(min_value=60, max_value=80))
def test_nan_and_inf_never_poison_statistics_afterwards(rows, n_clean):
    """After any garbage (NaN, Inf, huge values), a long clean constant run raises nothing."""
    engine = HealthEngine(P)
    for i, row in enumerate(rows):
        engine.step(StepRecord(step=i, **row))
    start = len(rows)
    late = []
    for j in range(n_clean):
        alerts = engine.step(
            StepRecord(step=start + j, loss=1.0, grad_norm=1.0, grad_max=0.1, activation_max=2.0)
        ).alerts
        if j >= 55:
            late += [a for a in alerts if a.severity is not Severity.INFO]
    for d in engine.detectors:  # every detector's rolling windows hold only finite values again
        windows = [w for w in _containers(d) if isinstance(w, deque)]
        assert all(math.isfinite(v) for w in windows for v in _floats(w)), type(d).__name__
    assert late == []


def _containers(obj, seen=None):
    """Every list, deque, dict, set and tuple reachable from a detector's own attributes (the
    policy and the records it merely refers to left out)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (Policy, StepRecord, str, bytes, int, float, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        yield obj
        for v in obj:
            yield from _containers(v, seen)
    elif isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _containers(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith("nummon"):
        if not type(obj).__module__.startswith("nummon._policy.policy"):
            yield from _containers(vars(obj), seen)


def _floats(container):
    for v in container.values() if isinstance(container, dict) else container:
        if isinstance(v, float):
            yield v
        elif isinstance(v, tuple):
            yield from (x for x in v if isinstance(x, float))


def _state_size(detector) -> int:
    return sum(len(c) for c in _containers(detector))


@pytest.mark.slow
def test_every_detector_keeps_bounded_memory_over_a_long_run():
    """The state each detector holds stops growing: 4x the records, no more elements."""
    engine = HealthEngine(P)
    sizes = []
    for n in (3000, 12000):
        for step in range(len(sizes) and 3000, n):
            noise = 1.0 + 0.01 * ((step * 7919) % 13)
            engine.step(
                StepRecord(
                    step=step,
                    loss=2.0 / (1 + step / 500) * noise,
                    grad_norm=noise,
                    grad_max=0.1 * noise,
                    param_norm=10.0,
                    activation_max=3.0 * noise,
                    update_ratio=1e-3,
                    lr=1e-3,
                    layer_grad_norms={"a": noise, "b": 0.5 * noise},
                )
            )
        engine.state_dict()  # (books the quiet records the fast path holds back: the state as of `n`)
        sizes.append({type(d).__name__: _state_size(d) for d in engine.detectors})
    assert len(sizes[1]) == len(engine.detectors) == len(build_detectors(P))
    assert {k: v for k, v in sizes[1].items() if v > sizes[0][k]} == {}
    assert sum(sizes[0].values()) > 0  # the measure sees the windows


@pytest.mark.parametrize("every", [2, 5])
def test_traces_logged_every_n_steps(every):
    """Windows are in steps and growth is per step, so sparse logs judge the same spans:
    healthy stays quiet, a recovered spike is never critical, a stall is still a stall."""
    import json

    from helpers.checkout import CORPUS as corpus

    from nummon import read_trace

    judged = ("healthy", "spike_recover", "shift_recover", "stall")
    labels = json.loads((corpus / "labels.json").read_text())
    seen = set()
    for name, lab in labels.items():
        if lab["label"] not in judged:
            continue
        seen.add(lab["label"])
        engine = HealthEngine(P)
        alerts = []
        fed = 0
        for i, rec in enumerate(read_trace(corpus / f"{name}.jsonl")):
            if i % every == 0:
                alerts += engine.step(rec).alerts
                fed += 1
        assert fed >= lab["steps"] // every, (name, fed)  # the sparse log was judged, not an empty one
        loud = [a for a in alerts if a.severity is not Severity.INFO]
        if lab["label"] == "healthy":
            assert loud == [], name
        elif lab["label"] == "stall":
            assert any(a.kind is AlertKind.STALL for a in loud), name
        else:
            assert not any(a.severity is Severity.CRITICAL for a in loud), name
    assert seen == set(judged)  # each kind of trace was judged (a renamed label would skip it)


def test_every_detector_declares_its_section_kinds_and_shared_needs():
    import inspect

    shared = shared_values(P)
    kinds = [k for cls in DETECTORS for k in cls.kinds]
    # replica_mismatch compares ranks, not records: nummon/_forensics/replicas.py raises it, no detector
    assert len(kinds) == len(set(kinds)) == len(AlertKind) - 1, "each kind has exactly one owner"
    assert AlertKind.REPLICA_MISMATCH not in kinds
    for cls in DETECTORS:
        assert cls.section in type(P).model_fields
        params = list(inspect.signature(cls.__init__).parameters)[1:]
        assert params == ["p", *cls.needs] and set(cls.needs) <= set(shared)
    off = Policy.model_validate({"stall": {"enabled": False}, "spike": {"enabled": False}})
    assert {d.section for d in build_detectors(off)} == {c.section for c in DETECTORS} - {"stall", "spike"}
