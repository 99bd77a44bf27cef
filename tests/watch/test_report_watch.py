"""`nummon watch` writes an incident report for each run it follows that reaches critical: into
`reports/` beside its state file, at the escalation and again at stop, named in the webhook text;
drawn from bounded memory, throttled per run."""

import math
import re
import signal
import subprocess
import sys

import pytest
from helpers import webhook_receiver
from helpers.checkout import ROOT
from helpers.watching import WATCH, two_incident_rows, wait_for, write_lines

from nummon import load_policy
from nummon._report import build_report
from nummon._report.page import render
from nummon._watch import make_follower
from nummon._watch.reports import LONG_VIEW, NEAR_MAX, RECENT, RunMemory
from nummon._watch.runs import WatchedRun
from nummon._watch.settings import WatchSettings
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher


def facts(html):
    """The incident facts a page states: [(label, value)] in page order."""
    return re.findall(r"<span>([^<]*)</span><b>([^<]*)</b>", html)


def pages(state):
    return sorted((state.parent / "reports").glob("*.html"))


@pytest.fixture
def receiver():
    r = webhook_receiver.Receiver()
    yield r
    r.close()


@pytest.mark.slow
def test_a_live_watch_writes_the_report_at_critical_and_names_it_in_the_webhook(tmp_path, receiver):
    rows = two_incident_rows()
    log = tmp_path / "runs" / "a" / "events.jsonl"
    log.parent.mkdir(parents=True)
    write_lines(log, rows[:60])  # incident 1: opened at 40, critical at 43
    state = tmp_path / "state" / "watch.json"
    proc = subprocess.Popen(
        WATCH
        + [str(tmp_path / "runs"), "--interval", "0.05", "--state", str(state)]
        + ["--notify", f"webhook:{receiver.url}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        wait_for(lambda: len(receiver.bodies) >= 2, what="the critical event")
        (page,) = pages(state)
        html = page.read_text()  # written at the escalation, while the watcher runs on
        assert ("critical", "step 43") in facts(html) and ("first warning", "step 40") in facts(html)
        assert "NaN" not in html.split("<footer>")[0].split("</h1>")[1][:400]  # not lost (yet)
        write_lines(log, rows[60:], mode="a")  # incident 1 resolves; incident 2 runs into NaN at 130
        wait_for(lambda: len(receiver.bodies) >= 6, what="the non-finite event")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    texts = {b["nummon"]["id"].split("#")[1]: b["text"] for b in receiver.bodies}
    for eid in ("1:escalated:2", "2:escalated:2", "2:escalated:3"):
        assert f"report: {page}" in texts[eid], eid  # the path, in the webhook's text
    assert "report:" not in texts["1:opened:1"] and "report:" not in texts["1:resolved:0"]
    html = page.read_text()  # drawn again at stop: the whole run
    assert [("first warning", "step 120"), ("critical", "step 123"), ("first NaN/Inf", "step 130")] == facts(html)[:3]
    assert ("critical", "step 43") in facts(html) and "Run lost at step 130" in html
    assert f"1 incident report under {page.parent}" in err


@pytest.mark.slow
def test_the_page_of_a_long_run_is_drawn_from_bounded_memory_and_tells_the_incident(tmp_path):
    """Thousands of healthy steps then a runaway into NaN: what the watcher holds stays bounded
    (the long view thinned), and its page states the same steps as `nummon report` over the
    whole log."""
    n = 2_000
    rows = [
        {"step": s, "loss": 2.0 * (1 + 0.03 * math.sin(1.3 * s)), "grad_norm": 1 + 0.1 * math.sin(s)} for s in range(n)
    ]
    rows += [{"step": n + k, "loss": 2.0 * 4**k, "grad_norm": 2.0**k} for k in range(1, 11)]
    rows += [{"step": n + 11, "loss": math.nan, "grad_norm": math.inf}]
    log = tmp_path / "long.jsonl"
    write_lines(log, rows)
    run = WatchedRun(str(log), make_follower(str(log)), load_policy("default"))
    run.memory = RunMemory()
    run.poll(final=True)
    data = run.memory.run_data(str(log), "jsonl")
    assert len(data.records) <= 32 + RECENT + NEAR_MAX + LONG_VIEW
    assert len(run.memory.long) <= LONG_VIEW and run.memory.stride >= n // LONG_VIEW
    assert data.records[0].step == 0 and data.records[-1].step == n + 11
    live = facts(render(data))
    whole = facts(build_report(log))
    assert live == whole and ("first NaN/Inf", f"step {n + 11}") in live


def test_a_second_escalation_soon_after_is_written_once_then_at_stop(tmp_path):
    """Throttled: within `min_interval_s` of a page the run's next critical step marks it due
    (its events still name it); the watcher's stop draws it."""
    rows = two_incident_rows()
    log = tmp_path / "runs" / "a.jsonl"
    log.parent.mkdir()
    write_lines(log, rows[:60])
    notes = tmp_path / "notes.jsonl"
    state = tmp_path / "state" / "watch.json"
    w = Watcher(
        [str(tmp_path / "runs")],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(state_path=str(state)),
    )
    w.reports.min_interval_s = 3600.0
    w.poll_once()
    (page,) = pages(state)
    assert w.reports.writes == 1 and ("critical", "step 43") in facts(page.read_text())
    write_lines(log, rows[60:], mode="a")
    w.poll_once()
    assert w.reports.writes == 1 and "step 130" not in page.read_text()  # throttled
    assert w.reports.due == {str(log)}
    w.close()
    assert w.reports.writes == 2 and ("first NaN/Inf", "step 130") in facts(page.read_text())
    from helpers.watching import read_events

    named = [e["id"].split("#")[1] for e in read_events(notes) if e.get("report") == str(page)]
    assert named == ["1:escalated:2", "2:escalated:2", "2:escalated:3"]


@pytest.mark.parametrize("policy, with_state", [({"report": {"enabled": False}}, True), ("default", False)])
def test_no_reports_when_the_policy_says_so_or_there_is_no_state_folder(tmp_path, policy, with_state):
    log = tmp_path / "runs" / "a.jsonl"
    log.parent.mkdir()
    write_lines(log, two_incident_rows())
    state = tmp_path / "state" / "watch.json"
    w = Watcher(
        [str(log.parent)],
        load_policy(policy),
        [],
        settings=WatchSettings(state_path=str(state) if with_state else None),
    )
    w.run(once=True)
    assert w.reports is None and not (tmp_path / "state" / "reports").exists()
    assert not list(tmp_path.rglob("*.html"))


def test_one_page_per_run_named_by_the_run(tmp_path):
    """Two runs that both reach critical: two pages, each named after its run (unique even when
    the short names would clash)."""
    rows = two_incident_rows()
    for name in ("x/events.jsonl", "x_events.jsonl"):
        p = tmp_path / "runs" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        write_lines(p, rows)
    state = tmp_path / "state.json"
    w = Watcher([str(tmp_path / "runs")], load_policy("default"), [], settings=WatchSettings(state_path=str(state)))
    w.run(once=True)
    got = pages(state)
    assert len(got) == 2 and all(p.name.startswith("x_events.jsonl-") for p in got)
    for p in got:
        assert "Run lost at step 130" in p.read_text()


@pytest.mark.parametrize("log", [b"run\xff/events.jsonl", b"r\xff.jsonl"])
def test_a_run_whose_name_is_not_utf8_gets_its_page_and_the_events_name_it(tmp_path, log):
    import os

    from helpers.watching import read_events

    path = tmp_path / "runs" / os.fsdecode(log)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lines(path, two_incident_rows())
    notes, state = tmp_path / "notes.jsonl", tmp_path / "state" / "watch.json"
    w = Watcher(
        [str(tmp_path / "runs")],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(state_path=str(state)),
    )
    w.run(once=True)
    (page,) = pages(state)
    assert [p.name for p in page.parent.iterdir()] == [page.name]  # no temporary file left
    assert "Run lost at step 130" in page.read_text(encoding="utf-8")
    named = {e["report"] for e in read_events(notes) if e.get("report")}
    assert named == {str(page)}


def test_when_reports_cannot_be_made_no_event_names_a_page(tmp_path):
    from helpers.watching import read_events

    log = tmp_path / "runs" / "a.jsonl"
    log.parent.mkdir()
    write_lines(log, two_incident_rows())
    notes, state = tmp_path / "notes.jsonl", tmp_path / "state" / "watch.json"
    state.parent.mkdir()
    (state.parent / "reports").write_text("a file where the folder would go")
    w = Watcher(
        [str(log.parent)],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(state_path=str(state)),
    )
    w.run(once=True)
    events = read_events(notes)
    assert any(e.get("state") == "nonfinite" for e in events)
    assert [e["report"] for e in events if e.get("report")] == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_the_page_of_a_100000_step_run_stays_under_2_mb(tmp_path):
    """Size (no timing): 100,000 steps with 8 layers each and an incident at the end draw a page
    well under 2 MB (far from the incident each stretch keeps its extremes only)."""
    from nummon import IncidentEvent, IncidentState
    from nummon._report.load import RunData, _new_record

    n, layers = 100_000, [f"block{i}.weight" for i in range(8)]
    records = [
        _new_record(
            {
                "step": s,
                "loss": 2.0 + math.sin(0.01 * s),
                "grad_norm": 1.0 + 0.1 * math.sin(s),
                "activation_max": 5.0,
                "headroom": 37.0,
                "layer_grad_norms": {name: 0.1 * (i + 1) for i, name in enumerate(layers)},
            }
        )
        for s in range(n)
    ]
    states = [(n - 20, IncidentState.OPEN, IncidentState.NONE), (n - 10, IncidentState.CRITICAL, IncidentState.OPEN)]
    states.append((n - 1, IncidentState.NONFINITE, IncidentState.CRITICAL))
    records[-1].loss = math.nan
    events = [IncidentEvent(s, st, prev, 1, n - 20).to_dict() for s, st, prev in states]
    html = render(RunData("generated", records, [], events))
    assert f"first NaN/Inf</span><b>step {n - 1}</b>" in html
    assert len(html.encode()) < 2_000_000
