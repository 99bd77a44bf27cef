"""A NaN that comes back. A non-finite condition clears only after
`nonfinite.clear_records` finite records in a row; a return within that stretch is the same
condition (announced again as recurring past the cooldown), a return after its clear is a new
alert that re-opens the incident; "cleared" names the metric. Live Monitor and replay alike."""

import json
import math
import subprocess

import pytest
import torch
from helpers.checkout import nummon_cmd
from helpers.detector_tester import engine_steps, loss_records
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nummon import AlertKind, IncidentState, Monitor, Policy, Severity, load_policy
from nummon._engine.detectors import DETECTORS

NAN = math.nan
#: NaN every few steps, finite in between (a common fp16 run), then NaN for good
RETURNING_NAN_LOSSES = [5.6, 5.3, 5.2, 5.0, NAN, 5.1, NAN, 5.9, 5.7, 5.5, NAN, 5.4] + [5.3, 5.2, NAN] * 8 + [NAN] * 5


def only_nonfinite(**alerts):
    """A policy with only the non-finite detector on (no stall or spike alerts in the way)."""
    off = {cls.section: {"enabled": False} for cls in DETECTORS if cls.section != "nonfinite"}
    nonfinite = {"clear_records": alerts.pop("clear_records")} if "clear_records" in alerts else {}
    return Policy.model_validate({**off, "nonfinite": nonfinite, "alerts": alerts})


def run(losses, policy):
    """(step, alerts, incident events) of each record, one record per step from step 0."""
    return [(step, got.alerts, got.incidents) for step, got in enumerate(engine_steps(loss_records(losses), policy))]


@settings(max_examples=150, deadline=None)
@given(
    bad=st.lists(st.booleans(), min_size=1, max_size=90),
    k=st.integers(1, 15),
    cooldown=st.integers(0, 30),
    quiet=st.integers(1, 60),
)
def test_lifecycle_invariants_over_random_finite_and_non_finite_steps(bad, k, cooldown, quiet):
    losses = [NAN if b else 2.0 + 0.1 * (i % 3) for i, b in enumerate(bad)]
    steps = run(losses, only_nonfinite(clear_records=k, cooldown_steps=cooldown, incident_quiet_steps=quiet))
    open_keys: set = set()  # conditions announced and not yet said to have cleared
    finite_run, cleared_once, incident_state = 0, False, IncidentState.NONE
    for (step, alerts, incidents), b in zip(steps, bad):
        nonfinite = [a for a in alerts if a.kind is AlertKind.NONFINITE]
        loud = [a for a in nonfinite if not a.cleared]
        clears = [a for a in nonfinite if a.cleared]
        finite_run = 0 if b else finite_run + 1
        # (b) a clear comes exactly at the k-th finite record in a row, and only then
        if clears:
            assert finite_run == k, (step, finite_run, k)
        if open_keys and finite_run == k:
            assert clears, f"step {step}: {k} finite records in a row and no clear"
        # (d) the cleared text names the metric
        for a in clears:
            assert a.message.startswith("cleared: loss finite again") and f"{k} finite record" in a.message
        # (c) the first non-finite record after a clear: a new alert, and the incident re-opens
        if b and cleared_once and not open_keys:
            assert [a.severity for a in loud] == [Severity.CRITICAL], step
            assert len(incidents) == 1 and incidents[0].state is IncidentState.NONFINITE, step
            ev = incidents[0]
            assert ev.reopened is not None or (ev.previous is IncidentState.RESOLVED and ev.number >= 2)
        open_keys |= {a.key for a in loud}
        open_keys -= {a.key for a in clears}
        cleared_once = cleared_once or bool(clears)
        # (a) no non-finite record passes with neither an alert nor an announced open condition
        if b:
            assert loud or open_keys, f"step {step}: non-finite and nothing said or open"
        for ev in incidents:
            incident_state = ev.state
    assert incident_state in (IncidentState.NONE, IncidentState.NONFINITE, IncidentState.RESOLVED)


def test_a_nan_returning_before_it_cleared_is_one_condition_announced_again_as_recurring():
    steps = run(RETURNING_NAN_LOSSES, load_policy("default"))
    said = [(s, a) for s, alerts, _ in steps for a in alerts if a.kind is AlertKind.NONFINITE]
    assert [(s, a.severity, a.cleared) for s, a in said] == [
        (4, Severity.CRITICAL, False),
        (26, Severity.CRITICAL, False),
    ]
    recurring = said[1][1]
    assert recurring.message.startswith("recurring: ") and recurring.details["recurring"]
    assert "non-finite again after 2 finite records (8 non-finite records since step 4)" in recurring.message


def test_a_one_off_nan_clears_naming_the_loss_and_a_return_after_it_reopens_the_incident():
    losses = [2.0] * 5 + [NAN] + [2.0] * 12 + [NAN] + [2.0] * 3
    steps = run(losses, only_nonfinite())
    said = {s: a for s, alerts, _ in steps for a in alerts}
    assert said[15].cleared and said[15].message == (
        "cleared: loss finite again, 10 finite records in a row (non-finite at step 5)"
    )
    assert said[18].severity is Severity.CRITICAL and not said[18].cleared  # within the 20-step cooldown of step 5
    (ev,) = steps[18][2]
    assert ev.state is IncidentState.NONFINITE and ev.reopened == 15
    assert "re-opened at step 18" in ev.summary() and "had cleared at step 15" in ev.summary()


def test_a_grad_scaler_calibration_and_one_off_nan_clear_within_the_stretch():
    """K finite records after the last non-finite one: the default 10 lets a scaler's opening
    skips and a single NaN clear long before its next overflow (thousands of steps away)."""
    losses = [NAN, NAN, NAN] + [2.0] * 9
    said = [a for _, alerts, _ in run(losses, only_nonfinite()) for a in alerts]
    assert not any(a.cleared for a in said)
    said = [a for _, alerts, _ in run(losses + [2.0], only_nonfinite()) for a in alerts]
    assert said[-1].cleared


def test_replay_of_a_returning_nan_says_the_nan_came_back(tmp_path):
    trace = tmp_path / "fp16_nan.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"step": i, "loss": "NaN" if math.isnan(v) else v}) + "\n"
            for i, v in enumerate(RETURNING_NAN_LOSSES)
        )
    )
    p = subprocess.run(
        nummon_cmd() + ["replay", "--format", "jsonl", str(trace)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    crit = [a for a in map(json.loads, p.stdout.splitlines()) if a["severity"] == "critical"]
    assert [a["step"] for a in crit] == [4, 26] and crit[1]["message"].startswith("recurring: ")


@pytest.mark.slow
def test_live_monitor_nan_every_few_steps_is_one_condition_and_its_return_after_a_clear_alerts():
    """A real model whose loss goes NaN at chosen steps (the inputs poisoned there)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy={"alerts": {"stop_on_critical": False}, "recorder": {"write": False}})
    bad = {4, 6, 10, 14, 17, 20, 23, 26, 45}
    crit, clears = [], []
    for step in range(60):
        x = torch.randn(8, 4)
        if step in bad:
            x[0, 0] = math.nan
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        r = mon.post_step(loss)
        if math.isfinite(loss.item()):  # a NaN step is skipped, as a scaler would: the weights stay finite
            opt.step()
        crit += [r.step for a in r.alerts if a.kind is AlertKind.NONFINITE and a.severity is Severity.CRITICAL]
        clears += [(r.step, a.message) for a in r.alerts if a.cleared and a.kind is AlertKind.NONFINITE]
    mon.close()
    assert crit[0] == 4 and 26 in crit and 45 in crit  # recurring past the cooldown; a new alert after the clear
    assert clears and clears[0][0] == 36 and all("finite again" in m for _, m in clears)
