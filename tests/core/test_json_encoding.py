"""One encoding of non-finite numbers in everything nummon writes: strict JSON, the same token for
the same value (alerts, incidents, step records, flight records), and the readers take the old forms."""

import json
import math

import pytest

from nummon import Alert, AlertKind, Contributor, IncidentEvent, IncidentState, JsonlSink, Monitor, Severity, read_trace
from nummon._core.json import dumps

TOKENS = {"NaN", "Infinity", "-Infinity"}


def strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)
    elif isinstance(obj, str):
        yield obj


def refuse(name):
    raise ValueError(f"bare {name}")


def test_alerts_incidents_and_contributors_write_the_same_token():
    c = Contributor(
        step=3,
        kind=AlertKind.RUNAWAY,
        severity=Severity.CRITICAL,
        metric="loss",
        value=math.inf,
        steps_to_overflow=math.inf,
        growth=-math.inf,
    )
    ev = IncidentEvent(
        step=3, state=IncidentState.CRITICAL, previous=IncidentState.NONE, number=1, opened_step=3, contributors=(c,)
    )
    alert = Alert(
        step=3,
        kind=AlertKind.RUNAWAY,
        severity=Severity.CRITICAL,
        message="m",
        metric="loss",
        value=math.inf,
        threshold=math.nan,
        details={"steps_to_overflow": math.inf},
    )
    d_ev = json.loads(dumps(ev.to_dict()), parse_constant=refuse)
    d_al = json.loads(dumps(alert.to_dict()), parse_constant=refuse)
    assert d_ev["contributors"][0]["value"] == d_al["value"] == "Infinity"
    assert d_ev["contributors"][0]["steps_to_overflow"] == d_al["details"]["steps_to_overflow"] == "Infinity"
    assert d_ev["contributors"][0]["growth"] == "-Infinity" and d_al["threshold"] == "NaN"


def test_a_runs_event_log_and_flight_record_hold_only_strict_tokens(tmp_path):
    log = tmp_path / "events.jsonl"
    mon = Monitor(sinks=[JsonlSink(log)], policy={"alerts": {"stop_on_critical": False}})
    for loss in [2.0] * 12 + [2.0 * 8**k for k in range(1, 6)] + [math.inf, math.nan]:
        mon.post_step(loss)
    mon.close()
    lines = [json.loads(line, parse_constant=refuse) for line in log.read_text().splitlines()]
    record = json.loads(mon.flight_record.read_text(), parse_constant=refuse)
    special = {s for s in strings(lines + [record]) if s.lower().lstrip("-") in ("inf", "infinity", "nan")}
    assert special and special <= TOKENS
    assert {"incident", "alert", "step"} <= {line["type"] for line in lines}
    losses = [r.loss for r in read_trace(log)]
    assert math.isinf(losses[-2]) and math.isnan(losses[-1])


@pytest.mark.parametrize("old", ['"inf"', '"nan"', "Infinity", "NaN", '"Infinity"'])
def test_the_reader_takes_the_old_forms(tmp_path, old):
    log = tmp_path / "old.jsonl"
    log.write_text(f'{{"type": "step", "step": 0, "loss": {old}}}\n')
    (rec,) = read_trace(log)
    assert not math.isfinite(rec.loss)
