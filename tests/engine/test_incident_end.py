"""An incident whose run became healthy again is said to have ended, also when the run stops
before the quiet period has passed; one whose condition is still open stays open."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import nummon
from nummon import Alert, AlertKind, IncidentState, MemorySink, Severity
from nummon._engine.incidents import IncidentTracker


def _alert(step, cleared=False):
    return Alert(
        step=step, kind=AlertKind.LOSS_SPIKE, severity=Severity.WARNING, message="m", metric="loss", cleared=cleared
    )


@given(opened=st.integers(0, 50), cleared_after=st.integers(0, 20), tail=st.integers(0, 40), quiet=st.integers(5, 60))
def test_a_settled_incident_ends_at_the_runs_end(opened, cleared_after, tail, quiet):
    tr = IncidentTracker(quiet_steps=quiet)
    cleared = opened + 1 + cleared_after
    last = cleared + tail
    events = []
    for step in range(last + 1):
        alerts = [_alert(step)] if step == opened else [_alert(step, cleared=True)] if step == cleared else []
        events += tr.update(step, alerts)
    ended = tr.close(last)
    if events[-1].state is IncidentState.RESOLVED:  # the quiet period passed within the run
        assert ended == [] and last - cleared >= quiet
    else:
        assert [(e.step, e.previous, e.state, e.number, e.opened_step) for e in ended] == [
            (last, IncidentState.OPEN, IncidentState.RESOLVED, 1, opened)
        ]
        assert "resolved at step" in ended[0].summary() and ended[0].title == "nummon: run recovered"
    assert tr.close(last) == []  # once


@given(opened=st.integers(0, 50), tail=st.integers(0, 40))
def test_an_incident_still_open_at_the_end_stays_open(opened, tail):
    tr = IncidentTracker(quiet_steps=50)
    for step in range(opened, opened + tail + 1):
        tr.update(step, [_alert(step)] if step == opened else [], conditions_open=True)
    assert tr.close(opened + tail) == [] and tr.state is IncidentState.OPEN


def test_a_monitored_run_whose_spike_cleared_ends_its_incident_at_close():
    """A tiny real model whose reported loss jumps 50x once at step 30 (a bad batch), then goes
    on healthy for 20 steps, fewer than the 50-step quiet period: the sinks hear it ended."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    sink = MemorySink()
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with nummon.Monitor(net, opt, sinks=[sink]) as mon:
        for step in range(50):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            mon.post_step(loss.item() * (50.0 if step == 30 else 1.0))
    states = [(e.step, e.state.value) for e in sink.incidents]
    assert states[0] == (30, "open") and states[-1] == (49, "resolved"), states
    assert [e.state.value for e in mon.incidents] == [s for _, s in states]
