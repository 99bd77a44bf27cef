"""The report's cost and memory, counted rather than timed: the work is linear in the records
and alerts whatever the number of incidents (each touched a bounded number of times), a page
tells a bounded number of incidents in full, and a long log is read in bounded memory."""

import math

import pytest

from nummon._report.load import RunData, _new_record
from nummon._report.page import render
from nummon._report.story import incidents_of


class Touches(list):
    """A list that counts the elements handed out (by iteration, index or slice)."""

    touched = 0

    def __iter__(self):
        Touches.touched += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        got = super().__getitem__(i)
        Touches.touched += len(got) if isinstance(i, slice) else 1
        return got


def many_incidents(n, every=20):
    """`n` incidents, each opened by a warning with a countdown and resolved 7 steps later."""
    records, alerts, events = [], [], []
    for i in range(n):
        base = i * every
        records += [
            _new_record({"step": s, "loss": 1.0 + 5.0 * (s == base + 5), "grad_norm": 1.0})
            for s in range(base, base + every)
        ]
        alerts.append(
            {"step": base + 5, "severity": "warning", "kind": "spike", "metric": "loss", "message": "m"}
            | {"details": {"steps_to_overflow": 3.0}}
        )
        events += [
            {"step": base + 5, "state": "open", "number": i + 1, "opened_step": base + 5},
            {"step": base + 12, "state": "resolved", "number": i + 1, "opened_step": base + 5},
        ]
    records[-1] = _new_record({"step": records[-1].step, "loss": math.nan})
    return records, alerts, events


@pytest.mark.parametrize("n", [50, 400, 2000])
def test_each_record_and_alert_is_touched_a_bounded_number_of_times_whatever_the_incidents(n):
    records, alerts, events = many_incidents(n)
    Touches.touched = 0
    html = render(RunData("generated", Touches(records), Touches(alerts), events))
    assert Touches.touched <= 30 * (len(records) + len(alerts))
    assert html.count("<section><h2>Incident ") == 8  # drawn in full: the worst eight
    assert "more incidents</h2>" in html


def test_only_the_incidents_a_page_tells_in_full_get_their_full_facts():
    records, alerts, events = many_incidents(300)
    views = incidents_of(RunData("generated", records, alerts, events), full=8)
    assert len(views) == 300 and sum(v.full for v in views) == 8
    assert all(v.alerts for v in views)  # every incident still knows its alerts and steps
    assert [v.countdowns == [] for v in views].count(False) == 8
