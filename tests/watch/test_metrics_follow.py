"""Exported state follows the run: at every record, each series `nummon watch --metrics`
serves equals what the health engine says after that record (the countdown of the runaways the
detectors measure now, absent when nothing runs away or the record is non-finite; the incident
and health now), never a value frozen at the alert that first reported it. Property-tested over
generated runs; the PrometheusSink's countdown (it sees alerts, not findings) is checked to
count down and to go away."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nummon import AlertKind, StepRecord, load_policy
from nummon._engine.engine import HealthEngine  # noqa: E402
from nummon._logs.discovery import RunSpec  # noqa: E402
from nummon._logs.readers import make_follower  # noqa: E402
from nummon._watch.metrics import HEALTH_CODES, FleetMetrics, MetricsObserver  # noqa: E402
from nummon._watch.runs import WatchedRun  # noqa: E402
from nummon.integrations.prometheus import PrometheusSink, _Collector  # noqa: E402

POLICY = load_policy("default")

# a run is a list of phases: calm noise, geometric growth (factor per step), non-finite steps,
# or a plateau at the level reached (growth stopped)
phase = st.one_of(
    st.tuples(st.just("calm"), st.integers(5, 40), st.just(1.0)),
    st.tuples(st.just("grow"), st.integers(3, 25), st.sampled_from([1.1, 1.5, 2.0, 3.0, 10.0])),
    st.tuples(st.just("nan"), st.integers(1, 4), st.just(1.0)),
    st.tuples(st.just("flat"), st.integers(3, 20), st.just(1.0)),
)


def records(phases, every=1):
    """StepRecords of a generated run (steps `every` apart; the first phase is forced calm so
    the detectors have a level)."""
    out, level, step = [], 2.0, 0
    for name, n, factor in [("calm", 30, 1.0), *phases]:
        for _i in range(n):
            wobble = 1 + 0.03 * math.sin(1.3 * step)
            if name == "grow":
                level = min(level * factor, 1e36)
                loss, g = level, math.sqrt(level)
            elif name == "nan":
                loss, g = math.nan, math.inf
            else:
                loss, g = level * wobble, math.sqrt(level) * (1 + 0.1 * math.sin(step))
            out.append(StepRecord(step=step, loss=loss, grad_norm=g))
            step += every
    return out


def scrape(fleet):
    """{(name, run): value} of one exposition of `fleet` (the same text a scrape gets)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(fleet))
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels.get("run"), s.labels.get("kind"), s.labels.get("severity")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def watched(tmp_path):
    """A watched run feeding a FleetMetrics through the watcher's observer; `run.last` holds
    what the engine concluded from the latest record."""
    log = tmp_path / "events.jsonl"
    log.write_text("")
    run = WatchedRun(str(log), make_follower(str(log), "jsonl"), POLICY)
    fleet = FleetMetrics()
    MetricsObserver(fleet).run_started(run, RunSpec(str(log), "jsonl", [str(log)]))
    observe = run.on_record

    def on_record(run_id, rec, got):
        run.last = got
        observe(run_id, rec, got)

    run.on_record = on_record
    return run, fleet


def findings_of_each_record(engine):
    """Record, test-side, the findings every detector gives for the record being processed."""
    got = []
    for d in engine.detectors:

        def update(rec, _orig=d.update):
            out = list(_orig(rec))
            got.extend(out)
            return out

        d.update = update
    return got


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(phases=st.lists(phase, min_size=1, max_size=4), every=st.sampled_from([1, 1, 10]))
def test_every_series_equals_what_the_engine_says_at_each_record(tmp_path, phases, every):
    run, fleet = watched(tmp_path)
    rid = run.id
    found = findings_of_each_record(run.engine)
    alerts: dict[tuple[str, str], int] = {}
    opened = 0
    loss = grad = None
    for rec in records(phases, every):
        found.clear()
        for ev in run.process(rec):
            opened += ev.event.state.active and not ev.event.previous.active
        got = scrape(fleet)
        engine = run.engine
        # the truth, from the engine and this record's findings
        countdown = [
            f.details["steps_to_overflow"]
            for f in found
            if f.kind is AlertKind.RUNAWAY
            and isinstance(f.details.get("steps_to_overflow"), float)
            and math.isfinite(f.details["steps_to_overflow"])
        ]
        want_ov = min(countdown) if countdown and rec.is_finite() else None
        assert got.get(("nummon_steps_to_overflow", rid, None, None)) == want_ov, (rec.step, rec.loss)
        assert got[("nummon_incident_state", rid, None, None)] == engine.incident_state.rank
        assert got[("nummon_health_state", rid, None, None)] == HEALTH_CODES[run.last.health]
        assert got[("nummon_last_step", rid, None, None)] == rec.step
        loss, grad = rec.loss if rec.loss is not None else loss, rec.grad_norm if rec.grad_norm is not None else grad
        assert same(got[("nummon_loss", rid, None, None)], loss) and same(
            got[("nummon_grad_norm", rid, None, None)], grad
        )
        for a in run.last.alerts:
            alerts[(a.kind.value, a.severity.value)] = alerts.get((a.kind.value, a.severity.value), 0) + 1
        assert {(k, s): v for (n, r, k, s), v in got.items() if n == "nummon_alerts_total"} == alerts
        assert got[("nummon_incidents_total", rid, None, None)] == opened


def same(a, b):
    return (a is None and b is None) or a == b or (math.isnan(a) and math.isnan(b))


def test_a_x3_runaway_counts_down_and_is_gone_once_non_finite(tmp_path):
    """x3 per step: the exported countdown falls record after record (it
    stayed at its first value for 34 records), and is absent from the non-finite record on."""
    run, fleet = watched(tmp_path)
    found = findings_of_each_record(run.engine)
    seen = []
    for rec in records([("grow", 70, 3.0), ("nan", 3, 1.0), ("calm", 3, 1.0)]):
        found.clear()
        run.process(rec)
        now = [f.details["steps_to_overflow"] for f in found if f.kind is AlertKind.RUNAWAY]
        seen.append(
            (rec, min(now) if now else None, scrape(fleet).get(("nummon_steps_to_overflow", run.id, None, None)))
        )
    growing = [(want, got) for rec, want, got in seen if rec.is_finite() and want is not None]
    assert len(growing) >= 20 and all(got == want for want, got in growing)  # recomputed at each record
    assert len({want for want, _ in growing}) > 1  # the engine's countdown moves (the gauge followed it)
    first_nan = next(i for i, (rec, _, _) in enumerate(seen) if not rec.is_finite())
    assert all(got is None for _, _, got in seen[first_nan:])  # non-finite: no countdown any more


def test_prometheus_sink_countdown_counts_down_and_goes_away(tmp_path):
    """PrometheusSink gets alerts and records (not the detectors' findings): its countdown
    falls with the steps after the runaway alert, and is gone at the non-finite record."""
    sink = PrometheusSink("127.0.0.1:0", run="r")  # never bound: no endpoint, the numbers only
    engine = HealthEngine(POLICY)
    seen = []
    for rec in records([("grow", 70, 3.0), ("nan", 2, 1.0), ("calm", 5, 1.0), ("grow", 40, 2.0), ("flat", 5, 1.0)]):
        got = engine.step(rec)
        for a in got.alerts:
            sink.on_alert(a)
        sink.on_step(rec, got.health)
        for ev in got.incidents:
            sink.on_incident(ev)
        (s,) = sink.metrics.snapshot().runs
        seen.append((rec, s.steps_to_overflow))
    first_nan = next(i for i, (r, _) in enumerate(seen) if not r.is_finite())
    counts = [v for _, v in seen[:first_nan] if v is not None]
    # not frozen at its first value: it falls record by record between alerts (a new alert may say more or less)
    assert len(counts) >= 10 and len(set(counts)) >= 4
    assert sum(b == a - 1 for a, b in zip(counts, counts[1:])) >= len(counts) // 2, counts
    assert all(v is None for _, v in seen[first_nan : first_nan + 7])
    assert seen[-1][1] is None  # the second runaway went flat: nothing runs away any more
