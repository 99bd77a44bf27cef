"""`--notify alertmanager:URL`: incident events as Alertmanager v2 alerts. Against a recording
endpoint on 127.0.0.1 (the payloads, re-posting, resolution, an HA pair with a dead member), and
against the real Alertmanager with the shipped route, forwarding to a webhook receiver."""

import json
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers.prometheus_servers import (
    Receiver,
    free_port,
    get_json,
    shipped_alertmanager_config,
    start_alertmanager,
    wait_for,
)

from nummon import NummonError, load_policy
from nummon._watch.alertmanager import ALERTNAME, AlertmanagerTarget
from nummon._watch.metrics import FleetMetrics
from nummon._watch.settings import WatchSettings
from nummon._watch.targets import parse_target
from nummon._watch.watcher import Watcher


def row(s):
    """Healthy to step 59, a runaway (loss x4, gradient norm x2 per step) from 60, NaN at 70,
    healthy again from 71 (the non-finite condition clears after nonfinite.clear_records finite records,
    the incident resolves after the policy's quiet steps)."""
    if 60 <= s < 70:
        loss, g = 4.0 ** (s - 59), 2.0 ** (s - 59)
    elif s == 70:
        loss, g = math.nan, math.inf
    else:
        loss, g = 2.0 * 0.99 ** min(s, 59) * (1 + 0.03 * math.sin(1.3 * s)), 1 + 0.1 * math.sin(s)
    return {"step": s, "loss": loss, "grad_norm": g, "learning_rate": 0.01, "epoch": s / 100}


def write_state(run_dir, rows):
    """A Hugging Face trainer_state.json, replaced atomically as the Trainer's checkpoints are."""
    tmp = run_dir / "trainer_state.json.tmp"
    tmp.write_text(json.dumps({"global_step": rows[-1]["step"], "max_steps": 1000, "log_history": rows}))
    os.replace(tmp, run_dir / "trainer_state.json")


def parse_time(s):
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


class AlertSink:
    """An Alertmanager stand-in on 127.0.0.1: records each POST /api/v2/alerts batch."""

    def __init__(self):
        batches = self.batches = []
        auth = self.auth = []
        times = self.times = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                auth.append(self.headers.get("Authorization"))
                batches.append((self.path, json.loads(self.rfile.read(n))))
                times.append(time.time())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self):
        return [a for _, b in self.batches for a in b]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Event:
    """A watcher incident event as its to_dict() gives it."""

    def __init__(self, level, transition, kind="runaway", run="runs/a", state=None):
        self.title = {0: "nummon: run recovered", 1: "nummon: run unstable", 3: "nummon: run lost"}.get(
            level, "nummon: run critical"
        )
        self._d = {
            "run": run,
            "level": level,
            "transition": transition,
            "title": self.title,
            "state": state or {0: "resolved", 1: "open", 2: "critical", 3: "nonfinite"}[level],
            "summary": f"run `{run}`: incident text {level}",
            "contributors": [{"kind": kind, "severity": "warning"}],
        }

    def to_dict(self):
        return dict(self._d)


@pytest.fixture
def sink():
    s = AlertSink()
    yield s
    s.close()


def test_one_alert_per_incident_reposted_while_open_and_ended_when_resolved(sink):
    t = AlertmanagerTarget(sink.url, repeat_s=0.2, host="watch-host")
    try:
        t.on_incident(Event(1, "opened", kind="loss_spike"))
        first = wait_for(lambda: sink.alerts(), 10, "the first post")[0]
        assert sink.batches[0][0] == "/api/v2/alerts"
        assert first["labels"] == {
            "alertname": ALERTNAME,
            "run": "runs/a",
            "severity": "warning",
            "state": "open",
            "kind": "loss_spike",
            "host": "watch-host",
        }
        assert first["annotations"] == {
            "summary": "nummon: run unstable",
            "description": "run `runs/a`: incident text 1",
        }
        assert parse_time(first["endsAt"]) > time.time()  # firing: it ends in the future unless re-posted
        # re-posted while open, same identity and start, its end pushed forward
        wait_for(lambda: len(sink.batches) >= 3, 10, "re-posts")
        again = sink.alerts()[-1]
        assert again["labels"] == first["labels"] and again["startsAt"] == first["startsAt"]
        assert parse_time(again["endsAt"]) > parse_time(first["endsAt"])
        # an escalation is a new identity: the open alert ends, the critical one fires
        n = len(sink.batches)
        t.on_incident(Event(2, "escalated"))
        batch = wait_for(lambda: next((b for _, b in sink.batches[n:] if len(b) == 2), None), 10, "the escalation")
        old, new = batch
        assert old["labels"]["state"] == "open" and parse_time(old["endsAt"]) <= time.time() + 1
        assert new["labels"]["state"] == "critical" and new["labels"]["severity"] == "critical"
        assert list(t.active()) == ["runs/a"]
        # resolved: the firing alert is posted once more, ended now; no more re-posts of it
        n = len(sink.batches)
        t.on_incident(Event(0, "resolved"))
        end = wait_for(
            lambda: next((b for _, b in sink.batches[n:] if parse_time(b[0]["endsAt"]) <= time.time() + 1), None),
            10,
            "the resolution",
        )
        assert end[0]["labels"] == new["labels"]
        assert t.active() == {}
        assert t.failed == 0
    finally:
        t.close()


def test_ha_pair_every_member_gets_each_alert_and_a_dead_member_is_counted(sink, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    t = parse_target(f"alertmanager:{dead},{sink.url}")
    t.timeout_s, t.retries, t.backoff_s = 1.0, 1, 0.01
    try:
        t.on_incident(Event(3, "opened", kind="nonfinite"))
        wait_for(lambda: t.failed >= 1, 20, "the dead member's failure")
        assert [a["labels"]["state"] for a in sink.alerts()][:1] == ["nonfinite"]
        assert t.sent >= 1  # the live member took it
        # what the watcher's metrics count, by target kind (never by URL)
        fleet = FleetMetrics()
        fleet.targets = [t]
        assert fleet.snapshot().failed == {"alertmanager": t.failed}
    finally:
        t.close()


@pytest.mark.parametrize("spec", ["alertmanager:", "alertmanager:ftp://x", "alertmanager:localhost:9093"])
def test_bad_alertmanager_url_is_named(spec):
    with pytest.raises(NummonError, match="alertmanager|expected"):
        parse_target(spec)


def test_url_credentials_are_basic_auth_and_never_logged(sink, caplog):
    import base64

    t = AlertmanagerTarget(
        f"http://user:s3cret@127.0.0.1:{free_port()},{sink.url.replace('//', '//am:p%40ss@')}",
        timeout_s=0.5,
        retries=0,
        repeat_s=0.2,
    )
    try:
        t.on_incident(Event(1, "opened"))
        wait_for(lambda: t.failed >= 3, 20, "three failures of the dead member")  # the first post and re-posts
    finally:
        t.close()
    assert sink.auth[0] == "Basic " + base64.b64encode(b"am:p@ss").decode() and sink.batches[0][0] == "/api/v2/alerts"
    assert "s3cret" not in caplog.text and "p%40ss" not in caplog.text and "p@ss" not in caplog.text
    assert caplog.text.count("could not deliver") == 1  # an outage is logged once; every failure is counted


# --- the real Alertmanager --------------------------------------------------------------------


@pytest.fixture
def alertmanager(tmp_path):
    receiver = Receiver()
    server = start_alertmanager(tmp_path, shipped_alertmanager_config(receiver.url))
    yield server, receiver
    server.stop()
    receiver.close()


def am_alerts(server, run):
    q = urllib.parse.urlencode({"filter": [f'alertname="{ALERTNAME}"', f'run="{run}"']}, doseq=True)
    return get_json(f"{server.url}/api/v2/alerts?{q}")


def test_runaway_reaches_the_receiver_before_its_nan_is_written_then_resolves(tmp_path, alertmanager):
    server, receiver = alertmanager
    root = tmp_path / "runs"
    run_dir = root / "bert-lr3e-3"
    run_dir.mkdir(parents=True)
    run = str(run_dir)
    rows = [row(s) for s in range(60)]
    write_state(run_dir, rows)
    target = AlertmanagerTarget(server.url, repeat_s=1.0)
    watcher = Watcher([str(root)], load_policy("default"), [target], errors=open(os.devnull, "w"))
    loop = threading.Thread(target=watcher.run, kwargs={"interval_s": 0.1}, daemon=True)
    loop.start()
    try:
        firing = lambda: [t for t in receiver.texts() if "[FIRING]" in t and run in t]  # noqa: E731
        for s in range(60, 70):  # the live run runs away, one record at a time
            rows.append(row(s))
            write_state(run_dir, rows)
            time.sleep(0.05)
        # before writing the non-finite step: has Alertmanager forwarded nummon's alert?
        wait_for(firing, 60, "Alertmanager to forward the runaway to the receiver")
        assert all(math.isfinite(r["loss"]) for r in rows)
        assert any("run unstable" in t or "run critical" in t for t in firing())
        rows.append(row(70))
        write_state(run_dir, rows)
        # one alert per open incident: the non-finite one, the earlier states ended
        lost = wait_for(
            lambda: [a for a in am_alerts(server, run) if a["labels"]["state"] == "nonfinite"],
            30,
            "the non-finite alert in Alertmanager",
        )
        assert len(am_alerts(server, run)) == 1
        assert lost[0]["labels"]["severity"] == "critical" and lost[0]["labels"]["kind"] == "nonfinite"
        assert "Incident 1 escalated" in lost[0]["annotations"]["description"]
        # re-posted while open: Alertmanager's endsAt moves forward
        ends = parse_time(lost[0]["endsAt"])
        wait_for(lambda: any(parse_time(a["endsAt"]) > ends for a in am_alerts(server, run)), 30, "a re-post")
        # the run recovers: the incident resolves, Alertmanager shows no active alert and says so
        rows.extend(row(s) for s in range(71, 140))  # the NaN clears after 10 finite records, then 50 quiet steps
        write_state(run_dir, rows)
        wait_for(lambda: am_alerts(server, run) == [], 30, "the alert to resolve in Alertmanager")
        wait_for(
            lambda: any(t.startswith("\n[RESOLVED]") and run in t for t in receiver.texts()),
            30,
            "the resolved message at the receiver",
        )
        assert target.failed == 0
    finally:
        watcher.stop.set()
        loop.join(30)


def test_restarted_watcher_reposts_the_open_incident_with_the_same_identity(sink, tmp_path):
    from nummon._core.json import dumps
    from nummon._watch.hooks import Observers

    log = tmp_path / "runs" / "a" / "events.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(
        "".join(
            dumps({"type": "step", **{k: row(s)[k] for k in ("step", "loss", "grad_norm")}}) + "\n" for s in range(66)
        )
    )  # the runaway is critical, not yet lost
    state = tmp_path / "state.json"

    def watcher(target):
        return Watcher(
            [str(tmp_path / "runs")],
            load_policy("default"),
            [target],
            settings=WatchSettings(state_path=str(state)),
            observer=Observers([target]),
            errors=open(os.devnull, "w"),
        )

    first_target = AlertmanagerTarget(sink.url)
    first = watcher(first_target)
    first.poll_once()
    first.close()
    firing = [a for a in sink.alerts() if parse_time(a["endsAt"]) > time.time() + 1]
    assert firing and firing[-1]["labels"]["state"] == "critical"
    n = len(sink.batches)
    again = watcher(AlertmanagerTarget(sink.url))
    try:
        again.poll_once()  # nothing new in the log: only the resumed alert is posted
        (resumed,) = wait_for(lambda: [a for _, b in sink.batches[n:] for a in b], 10, "the re-post")
        assert resumed["labels"] == firing[-1]["labels"]
        assert "re-posted after the watcher restarted" in resumed["annotations"]["description"]
        assert parse_time(resumed["endsAt"]) > time.time()
    finally:
        again.close()


def test_two_alertmanager_targets_are_two_in_the_outbox_and_failures_count_once(sink):
    from nummon._watch.metrics import MetricsObserver

    a, b = parse_target(f"alertmanager:{sink.url}"), parse_target(f"alertmanager:{sink.url}/other")
    try:
        assert a.key != b.key and a.key.startswith("alertmanager:")
        assert a.shown == f"alertmanager {sink.url}/…"
        fleet = FleetMetrics()
        fleet.targets = [a]
        a.failed = 1  # counted by the target itself; the watcher's hook must not count it again
        MetricsObserver(fleet).target_failed(a)
        assert fleet.snapshot().failed == {"alertmanager": 1}
    finally:
        a.close()
        b.close()


# --- a hung member, a hung Alertmanager, redirects, a deleted run -----------------------------


class Hung:
    """An address that accepts connections (the kernel's backlog) and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(200)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()


@pytest.fixture
def hung():
    h = Hung()
    yield h
    h.close()


def test_ha_pair_with_a_hung_member_the_live_one_gets_every_alert_at_once(sink, hung):
    t = AlertmanagerTarget([hung.url, sink.url], timeout_s=5.0, retries=2, backoff_s=0.5)
    try:
        t.on_incident(Event(1, "opened"))
        t.on_incident(Event(3, "escalated", kind="nonfinite"))
        # the hung member holds each post for 5 s (x3 tries): the live one must not wait for it
        wait_for(lambda: [a for a in sink.alerts() if a["labels"]["state"] == "nonfinite"], 3, "the non-finite alert")
        assert [a["labels"]["state"] for a in sink.alerts()][:1] == ["open"]
    finally:
        t.close(timeout_s=0.1)


def test_hung_alertmanager_every_dropped_batch_is_counted_and_said(hung, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="nummon.watch")
    t = AlertmanagerTarget(hung.url, timeout_s=0.3, retries=0, queue_size=5, repeat_s=60)
    fleet = FleetMetrics()
    fleet.targets = [t]
    try:
        for i in range(60):  # 60 events, one batch each, against a queue of 5 that never drains in time
            t.on_incident(Event(1 + i % 2, "escalated", run=f"runs/{i % 7}"))
        assert t.dropped >= 50
        assert fleet.snapshot().failed["alertmanager"] >= t.dropped  # every dropped batch is a failure Prometheus sees
    finally:
        t.close(timeout_s=0.2)
    behind = [r.getMessage() for r in caplog.records if "is behind" in r.getMessage()]
    assert len(behind) == 1  # once per burst
    counted = [r.getMessage() for r in caplog.records if "dropped while it was behind" in r.getMessage()]
    assert sum(int(re.search(r"(\d+) alert batch", m).group(1)) for m in counted) == t.dropped


class Recorder:
    """Any request, any method: (method, path, Authorization) recorded, 200 answered."""

    def __init__(self, redirect_code=None, location=None):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length", 0) or 0)
                self.rfile.read(n)
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                if redirect_code:
                    self.send_response(redirect_code)
                    self.send_header("Location", location)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_a_redirect_is_never_followed_and_is_a_failure(code, caplog):
    elsewhere = Recorder()
    redirecting = Recorder(code, elsewhere.url + "/api/v2/alerts")
    t = AlertmanagerTarget(redirecting.url.replace("//", "//am:s3cret@"), timeout_s=2, retries=1, backoff_s=0.01)
    try:
        t.on_incident(Event(3, "opened", kind="nonfinite"))
        wait_for(lambda: t.failed >= 1, 10, "the redirect counted as a failure")
        time.sleep(0.2)
        assert elsewhere.seen == []  # neither a GET nor the credentials went to the other address
        assert t.sent == 0 and len(redirecting.seen) == 1  # final: not retried either
        assert f"HTTP {code}" in caplog.text and "not followed" in caplog.text and "s3cret" not in caplog.text
    finally:
        t.close(timeout_s=0.1)
        elsewhere.close()
        redirecting.close()


def test_a_run_deleted_while_watched_has_its_alert_ended_once(sink, tmp_path):
    import shutil

    from nummon._core.json import dumps
    from nummon._watch.hooks import Observers

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(
        "".join(
            dumps({"type": "step", **{k: row(s)[k] for k in ("step", "loss", "grad_norm")}}) + "\n" for s in range(71)
        )
    )  # lost at step 70
    target = AlertmanagerTarget(sink.url, repeat_s=0.2)
    watcher = Watcher(
        [str(tmp_path / "runs")],
        load_policy("default"),
        [target],
        observer=Observers([target]),
        errors=open(os.devnull, "w"),
    )
    try:
        watcher.poll_once()
        run = str(run_dir / "events.jsonl")
        wait_for(
            lambda: [a for a in sink.alerts() if a["labels"]["run"] == run and a["labels"]["state"] == "nonfinite"],
            10,
            "the non-finite alert",
        )
        shutil.rmtree(run_dir)
        deleted = time.time()
        for _ in range(15):  # the watcher goes on (1.5 s: 7 re-post intervals)
            watcher.poll_once()
            time.sleep(0.1)
        after = [
            (a, t)
            for (_, b), t in zip(sink.batches, sink.times)
            for a in b
            if t > deleted and a["labels"]["run"] == run
        ]
        assert len(after) <= 2 and after, after  # at most one re-post in flight, then its end
        assert parse_time(after[-1][0]["endsAt"]) <= time.time()  # the last word is its end ...
        assert target.active() == {}  # ... and it is never re-posted
        n = len(sink.batches)
        time.sleep(0.6)
        assert len(sink.batches) == n
    finally:
        watcher.close()


@pytest.mark.slow
def test_shipped_route_gives_one_message_per_incident_transition(tmp_path):
    """Through the shipped alertmanager.yml: a run that opens an incident, escalates to critical,
    goes non-finite and recovers gives one message per transition (4), each with one firing
    alert at most (the escalation's ended alert rides in the same message), a title that is
    never blank, and Slack mrkdwn."""
    from helpers import webhook_receiver

    from nummon._core.json import dumps

    slack, hook = Receiver(), webhook_receiver.Receiver("/am")
    server = start_alertmanager(tmp_path, shipped_alertmanager_config(slack.url, hook.url))
    log = tmp_path / "runs" / "a" / "events.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("")
    target = AlertmanagerTarget(server.url, repeat_s=1.0)
    watcher = Watcher([str(tmp_path / "runs")], load_policy("default"), [target], errors=open(os.devnull, "w"))
    states = []
    try:
        for s in range(150):
            with open(log, "a") as fh:
                fh.write(dumps({"type": "step", **{k: row(s)[k] for k in ("step", "loss", "grad_norm")}}) + "\n")
            watcher.poll_once()
            now = next(iter(target.active().values()), {"labels": {"state": "resolved"}})["labels"]["state"]
            if now != (states[-1] if states else "resolved"):
                states.append(now)
                wait_for(lambda: len(hook.bodies) >= len(states), 20, f"the message of the {now} transition")
                time.sleep(1.5)  # past the group interval: the next transition is a message of its own
        time.sleep(3)  # nothing more comes (no duplicate, no re-post as a message)
    finally:
        watcher.stop.set()
        watcher.close()
        server.stop()
        slack.close()
        hook.close()
    assert states == ["open", "critical", "nonfinite", "resolved"]
    assert len(hook.bodies) == len(slack.bodies) == 4, [b["status"] for b in hook.bodies]
    firing = [[a["labels"]["state"] for a in b["alerts"] if a["status"] == "firing"] for b in hook.bodies]
    assert firing == [["open"], ["critical"], ["nonfinite"], []]
    titles = [a.get("title", "") for b in slack.bodies for a in b.get("attachments", [])]
    assert len(titles) == 4 and all(t.split("] ", 1)[1].strip() for t in titles), titles
    assert titles[-1].startswith("[RESOLVED]") and all(t.startswith("[FIRING]") for t in titles[:3])
    texts = [a.get("text", "") for b in slack.bodies for a in b.get("attachments", [])]
    assert not any("**" in t for t in texts) and any("*critical*" in t or "*nonfinite*" in t for t in texts), texts


def test_runs_named_with_a_newline_and_with_a_backslash_n_are_two_alerts(sink, tmp_path):
    """A folder named "a<newline>b" and one named "a\\nb" (a backslash and an n) are two runs: their
    `run` labels differ, so Alertmanager never merges their alerts."""
    root = tmp_path / "runs"
    names = ["a\nb", "a\\nb"]
    for name in names:
        (root / name).mkdir(parents=True)
        rows = [{"type": "step", "step": s, "loss": 2.0 * 0.99**s * (1 + 0.03 * math.sin(1.3 * s))} for s in range(40)]
        rows.append({"type": "step", "step": 40, "loss": math.nan})
        (root / name / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = AlertmanagerTarget(sink.url, repeat_s=60)
    watcher = Watcher([str(root)], load_policy("default"), [target], errors=open(os.devnull, "w"))
    try:
        watcher.poll_once(final=True)
        wait_for(lambda: len({a["labels"]["run"] for a in sink.alerts()}) >= 2 or None, 10, "two run labels")
        runs = {a["labels"]["run"] for a in sink.alerts()}
        assert len(runs) == 2, runs
        assert {r.split("/")[-2] for r in runs} == {"a\\nb", "a\\\\nb"}  # escaped, reversibly
    finally:
        watcher.close()
        target.close()
