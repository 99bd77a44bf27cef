"""The console sink: alerts through the "nummon" logger, with their hint."""

import logging

import nummon
from nummon import AlertKind, Severity


def test_console_sink_shows_the_hint(caplog):
    sink = nummon.ConsoleSink(per_alert=True)
    with caplog.at_level(logging.WARNING, logger="nummon"):
        sink.on_alert(
            nummon.Alert(
                step=3,
                kind=AlertKind.RUNAWAY,
                severity=Severity.CRITICAL,
                message="m",
                metric="loss",
                hint="lower the LR",
            )
        )
    assert "hint: lower the LR" in caplog.text


def _runaway_run(console, folder):
    """A loop whose loss runs away into NaN, then recovers and stays quiet until the incident resolves."""
    memory = nummon.MemorySink()
    mon = nummon.Monitor(sinks=[console, memory], run_dir=folder, policy={"alerts": {"stop_on_critical": False}})
    losses = [2.0 * 0.99**s * (1 + 0.03 * ((s * 7) % 5)) for s in range(40)]
    losses += [2.0 * 4.0**k for k in range(1, 8)] + [float("nan")]
    losses += [1.5 * 0.999**s * (1 + 0.03 * ((s * 7) % 5)) for s in range(200)]
    for loss in losses:
        mon.post_step(loss)
    mon.close()
    return memory.incidents


def test_the_console_says_each_incident_transition_in_one_line(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="nummon"):
        events = _runaway_run(nummon.ConsoleSink(), tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nummon: run ")]
    assert len(events) >= 3 and [e.state.value for e in events][-1] == "resolved"
    assert len(lines) == len(events)  # one line per transition, nothing else
    for line, event in zip(lines, events):
        assert "\n" not in line
        assert line.startswith(event.title + " | ")
        assert f"at step {event.step}" in line and f"incident {event.number} " in line
        if event.state.value != "resolved":
            top = max(event.contributors, key=lambda c: (c.severity.rank, c.step))
            assert f"{top.severity.value} {top.kind.value}:" in line
            more = len(event.contributors) - 1
            assert (f"(+{more} more)" in line) == (more > 0), (line, more)


def test_a_verbose_console_puts_the_incidents_summary_under_its_line(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="nummon"):
        events = _runaway_run(nummon.ConsoleSink(verbose=True), tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nummon: run ")]
    assert len(messages) == len(events)
    assert all(m.count("\n") >= 1 and f"Incident {e.number}" in m for m, e in zip(messages, events))


def test_a_rollback_is_said_by_where_it_went_not_by_a_step_number_of_minus_one():
    from nummon._core.alert_text import value_text

    start = {"recovery": "rollback", "to_step": -1}
    assert value_text(AlertKind.EXPLOSION, "recovery", -1.0, start) == "rolled back to the start (before step 0)"
    assert value_text(AlertKind.EXPLOSION, "recovery", 30.0, {**start, "to_step": 30}) == "rolled back to step 30"
