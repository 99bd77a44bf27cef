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
