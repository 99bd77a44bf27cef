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


def _long_log(path, n, layers=24):
    """A Monitor event log of `n` step lines with per-layer values (GPT-2-like lines, smaller),
    one incident near the end that goes non-finite. The loss falls as a healthy run's does (a
    flat one is a stall, judged in full on every record: 3x the time, nothing more tested)."""
    import json

    names = [f"transformer.h.{i}.mlp.c_fc.weight" for i in range(layers)]
    with open(path, "w") as fh:
        for s in range(n):
            loss = 3.0 / (1 + s / 100) * (1 + 0.02 * math.sin(s / 5)) if s < n - 10 else 3.0 * 8.0 ** (s - n + 11)
            row = {"type": "step", "step": s, "loss": loss if s < n - 1 else "NaN", "grad_norm": 1.0 + (s % 7) / 50}
            row["layer_grad_norms"] = {k: 0.01 * (i + 1) + 1e-6 * s for i, k in enumerate(names)}
            row["layer_activation_max"] = {k: 5.0 + (s % 11) for k in names}
            fh.write(json.dumps(row) + "\n")
            if s == n - 10:
                fh.write(
                    json.dumps({"type": "incident", "step": s, "state": "open", "number": 1, "opened_step": s}) + "\n"
                )
                fh.write(
                    json.dumps(
                        {
                            "type": "alert",
                            "step": s,
                            "severity": "warning",
                            "kind": "explosion",
                            "metric": "loss",
                            "message": "up",
                        }
                    )
                    + "\n"
                )
        last = {"type": "incident", "step": n - 1, "state": "nonfinite", "number": 1, "opened_step": n - 10}
        fh.write(json.dumps(last) + "\n")
    return path


def _peak(fn):
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("maker", ["nummon report", "Monitor.close"])
def test_a_long_log_is_read_in_bounded_memory(tmp_path, maker):
    """tracemalloc's peak while the page is made (by `nummon report`, or at a Monitor's close
    from its run folder's event log): four times the lines, about the same peak (the records far
    from the incident are kept as each bucket's extremes, never all)."""
    from nummon._report import build_report
    from nummon._report.live import LiveReport

    def make(folder):
        if maker == "nummon report":
            return build_report(folder)
        LiveReport(lambda: folder).from_folder(lambda: None)
        return (folder / "nummon-report.html").read_text()

    folders = {n: tmp_path / str(n) for n in (2_500, 10_000)}
    for n, folder in folders.items():
        folder.mkdir()
        _long_log(folder / "events.jsonl", n)
    pages = {}
    peaks = [_peak(lambda n=n, f=f: pages.setdefault(n, make(f))) for n, f in folders.items()]
    assert peaks[1] < 1.5 * peaks[0], peaks
    for n, page in pages.items():
        assert f"{n:,} records, steps 0–{n - 1}" in page
        assert f"first NaN/Inf</span><b>step {n - 1}</b>" in page
