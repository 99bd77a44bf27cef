"""`nummon watch` as an unattended process: FIFOs in the tree, unwritable and broken state files,
bad targets, endpoints that hang, redirect, answer slowly or refuse, two watchers on one state
file, and what the watcher says where people look."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.watching import (
    WATCH,
    read_events,
    reference_ids,
    start_watch,
    stop,
    two_incident_rows,
    wait_for,
    write_lines,
)
from helpers.watching import watch_main as main

from nummon import load_policy
from nummon._watch.watcher import Watcher
from nummon._watch.webhook import WebhookTarget


class Endpoint:
    """An HTTP server on 127.0.0.1 that records each request and answers as told: `status`,
    `location` (a redirect), `slow_s` (answers late), `hang` (an Event: answers once it is set)."""

    def __init__(self, status=200, location=None, slow_s=0.0, hang=None):
        self.requests = []
        self.got = threading.Event()
        me = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(n) if n else b""
                me.requests.append((self.command, self.path, json.loads(body) if body else None))
                me.got.set()
                if me.hang is not None:
                    me.hang.wait(120)
                if me.slow_s:
                    time.sleep(me.slow_s)  # the scenario: a receiver slower than the client's timeout
                self.send_response(me.status)
                if me.location:
                    self.send_header("Location", me.location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_POST = do_GET = _any

            def log_message(self, *a):
                pass

        self.status, self.location, self.slow_s, self.hang = status, location, slow_s, hang
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ids(self):
        return [b["event_id"] for m, _, b in self.requests if m == "POST"]

    def close(self):
        if self.hang is not None:
            self.hang.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints():
    made = []

    def make(**kw):
        made.append(Endpoint(**kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def run_log(tmp_path, rows=None):
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir(exist_ok=True)
    write_lines(log, rows or two_incident_rows())
    return log


def run_once(*args):
    return subprocess.run(WATCH + [str(a) for a in args] + ["--once"], capture_output=True, text=True, timeout=300)


# --- a FIFO under the root -----------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_in_the_tree_never_blocks_and_sigterm_stops_the_watcher(tmp_path):
    log = run_log(tmp_path)
    os.mkfifo(tmp_path / "run" / "pipe.jsonl")
    os.mkfifo(tmp_path / "run" / "events.out.tfevents.1.host")
    notes = tmp_path / "notes.jsonl"
    proc = start_watch(tmp_path / "run", "--interval", "0.2", "--notify", f"jsonl:{notes}")
    try:
        wait_for(lambda: any(e["state"] == "nonfinite" for e in read_events(notes)), what="the NaN notified")
    finally:
        rc, out, err = stop(proc)  # a real SIGTERM; a watcher stuck in open() would ignore it
    assert rc == 0 and "Traceback" not in err
    assert [e["id"] for e in read_events(notes)] == reference_ids(log)
    assert main([str(tmp_path / "run" / "pipe.jsonl"), "--once"]) == 2  # named as a root: one line


# --- a state file that cannot be written ---------------------------------------------------

LIMITED = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the state file is larger: EFBIG
from nummon._cli import main
sys.exit(main(["watch", *sys.argv[1:]]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_unwritable_state_file_still_sends_every_notification(tmp_path, endpoints):
    ep = endpoints()
    log = run_log(tmp_path)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            LIMITED,
            str(log),
            "--once",
            "--state",
            str(tmp_path / "s.json"),
            "--notify",
            f"webhook:{ep.url}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert len(ep.ids()) == len(reference_ids(log)) == 6
    assert p.stderr.count("cannot write the state file") == 1 and "Traceback" not in p.stderr


# --- broken state files, paths under a regular file ----------------------------------------


@pytest.mark.parametrize(
    "state,needle",
    [
        (
            {"version": 1, "runs": {"r": {"position": {"offset": "abc"}}}, "outbox": []},
            "offset must be a non-negative integer",
        ),
        ({"version": 1, "runs": {}, "outbox": [1, 2]}, "outbox[0]"),
        ({"version": 1, "runs": {"r": []}, "outbox": []}, "must be a mapping"),
        ({"version": 1, "runs": {"r": {"history": "x"}}, "outbox": []}, "history must be a list"),
    ],
)
def test_state_file_with_wrong_field_types_is_one_line_exit_2(tmp_path, capsys, state, needle):
    log = run_log(tmp_path)
    s = tmp_path / "s.json"
    s.write_text(json.dumps(state))
    assert main([str(log), "--once", "--state", str(s)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--notify", "--state"])
def test_target_or_state_under_a_regular_file_is_one_line_exit_2(tmp_path, capsys, flag):
    log = run_log(tmp_path)
    (tmp_path / "FILE").write_text("x")
    arg = f"jsonl:{tmp_path}/FILE/x.jsonl" if flag == "--notify" else f"{tmp_path}/FILE/s.json"
    assert main([str(log), "--once", flag, arg]) == 2
    err = capsys.readouterr().err
    assert "FILE" in err and len(err.strip().splitlines()) == 1


# --- malformed webhook URLs refused at start -----------------------------------------------


@pytest.mark.parametrize("url", ["http://[::1", "http://a b/", "http://:80/x", "http://h:99999/", "https://"])
def test_malformed_webhook_url_exits_2_at_start(tmp_path, capsys, url):
    log = run_log(tmp_path)
    assert main([str(log), "--once", "--notify", f"webhook:{url}"]) == 2
    err = capsys.readouterr().err
    assert "webhook" in err and len(err.strip().splitlines()) == 1


# --- SIGTERM with an endpoint that never answers -------------------------------------------


@pytest.mark.slow
def test_sigterm_with_a_hanging_endpoint_keeps_the_events_for_the_next_start(tmp_path, endpoints):
    hang = threading.Event()
    ep = endpoints(hang=hang)
    log = run_log(tmp_path)
    state = tmp_path / "s.json"
    proc = start_watch(log, "--interval", "1", "--state", state, "--notify", f"webhook:{ep.url}")
    try:
        assert ep.got.wait(120), "the first event never reached the endpoint"
    finally:
        rc, out, err = stop(proc)
    # it did not wait for the hanging request to time out and be retried: nothing was called lost,
    # and every event not confirmed is still in the outbox
    assert rc == 0 and "could not deliver" not in err and "kept in" in err, err
    pending = json.loads(state.read_text())["outbox"]
    assert len(pending) == 6 and all(item["pending"] for item in pending)
    hang.set()
    p = run_once(log, "--state", state, "--notify", f"webhook:{ep.url}")
    assert p.returncode == 0, p.stderr
    assert ep.ids()[-6:] == [i["event"]["event_id"] for i in pending]  # at least once, the same ids
    assert json.loads(state.read_text())["outbox"] == []


# --- the failure line: no secret, the reason, the event ------------------------------------


def test_failure_line_names_reason_and_event_and_never_the_secret(tmp_path):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: connection refused
    url = f"http://user:pw0rd@127.0.0.1:{port}/services/T000/B000/XOXB-SECRET"
    log = run_log(tmp_path, two_incident_rows()[:50])
    errors = tmp_path / "err.txt"
    with open(errors, "w") as fh:
        w = Watcher([str(log)], load_policy("default"), [WebhookTarget(url, retries=1, backoff_s=0.01)], errors=fh)
        w.poll_once(final=True)
        w._drain(w.stop, 60)
        w.close()
    err = errors.read_text()
    assert "XOXB-SECRET" not in err and "pw0rd" not in err and "user" not in err
    assert f'webhook http://127.0.0.1:{port}/…: could not deliver "nummon: run unstable' in err
    assert "connection refused; 2 tries)" in err and w.lost == 2


def test_redirect_to_another_host_is_not_followed_and_reported(tmp_path, endpoints):
    other = endpoints()
    ep = endpoints(status=302, location=other.url)
    log = run_log(tmp_path)
    p = run_once(log, "--notify", f"webhook:{ep.url}")
    assert other.requests == []  # nothing went to the other address, neither GET nor POST
    assert p.returncode == 1 and p.stderr.count("HTTP 302 redirect") == 6 and "not followed" in p.stderr
    assert len(ep.ids()) == 6  # one try each: a redirect is final


def test_refused_notifications_make_once_exit_non_zero_with_plural_right(tmp_path, endpoints):
    ep = endpoints(status=403)
    log = run_log(tmp_path, two_incident_rows()[:50])
    p = run_once(log, "--notify", f"webhook:{ep.url}")
    assert p.returncode == 1
    assert (
        "HTTP 403" in p.stderr
        and "HTTP 403 Forbidden: the endpoint refuses the message; 1 try)" in p.stderr
        and "1 tries" not in p.stderr
    )


# --- a slow receiver gets each event once, nothing delivered is called lost ----------------


@pytest.mark.slow
def test_slow_receiver_gets_each_event_once_and_close_keeps_the_last(tmp_path, endpoints):
    ep = endpoints(slow_s=0.6)
    log = run_log(tmp_path)
    hook = WebhookTarget(ep.url, timeout_s=0.2, backoff_s=0.05)  # answers take 3x the send timeout
    errors = tmp_path / "err.txt"
    with open(errors, "w") as fh:
        w = Watcher([str(log)], load_policy("default"), [hook], errors=fh)
        w.poll_once(final=True)
        w.close(timeout_s=60)  # close waits for the queue: the last event is not dropped
    expect = reference_ids(log)
    assert len(ep.ids()) == len(expect) == 6 and len(set(ep.ids())) == 6
    assert w.lost == 0 and "could not deliver" not in errors.read_text() and hook.sent == 6


# --- one watcher per state file ------------------------------------------------------------


def test_second_watcher_on_the_same_state_exits_2_naming_the_first(tmp_path):
    log = run_log(tmp_path)
    state = tmp_path / "s.json"
    first = start_watch(log, "--interval", "0.2", "--state", state)
    try:
        lock = Path(f"{state}.lock")
        wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.pid), what="the first watcher's lock")
        p = run_once(log, "--state", state)
    finally:
        rc, _, err = stop(first)
    assert p.returncode == 2 and f"in use by another nummon watch (pid {first.pid})" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and rc == 0, err


# --- what the watcher says -----------------------------------------------------------------


def test_watch_names_what_it_watches_and_an_empty_root(tmp_path):
    run_log(tmp_path)
    (tmp_path / "empty").mkdir()
    p = run_once(tmp_path / "run", tmp_path / "empty", "--notify", f"jsonl:{tmp_path / 'n.jsonl'}")
    assert p.returncode == 0
    first = p.stderr.splitlines()[0]
    assert first.startswith("nummon watch: watching 1 run under ") and "(jsonl)" in first and "jsonl " in first
    assert f"{tmp_path / 'empty'}: no runs yet" in p.stderr


def test_title_cut_at_a_word():
    from nummon import AlertKind, Contributor, IncidentEvent, IncidentState, Severity
    from nummon._watch.notices import RunIncident

    c = Contributor(
        kind=AlertKind.RUNAWAY,
        metric="layer_grad_norms.encoder.blocks.11.attention.output_projection",
        severity=Severity.WARNING,
        step=3,
        value=1.0,
    )
    ev = IncidentEvent(
        step=3, state=IncidentState.OPEN, previous=IncidentState.NONE, number=1, opened_step=3, contributors=(c,)
    )
    title = RunIncident("r", ev).title
    assert (
        len(title) <= 63
        and title.endswith("…")
        and title[:-1].rstrip() in ("nummon: run unstable: runaway in", "nummon: run unstable: runaway")
    )


@pytest.mark.slow
def test_replay_without_the_extra_gives_the_install_hint(tmp_path):
    from helpers.log_writers import write_tensorboard

    tb = write_tensorboard(tmp_path / "tb", [(s, 1.0, 1.0) for s in range(5)])
    wb = tmp_path / "run-x.wandb"
    wb.write_bytes(b":W&B" + b"\xe1\xbe\x01")
    for path, extra in ((tb, "tensorboard"), (wb, "wandb")):
        code = (
            "import sys; sys.modules['tensorboard'] = None; sys.modules['wandb'] = None\n"
            "from nummon._cli import main; sys.exit(main(sys.argv[1:]))"
        )
        p = subprocess.run(
            [sys.executable, "-c", code, "replay", str(path)], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert f"pip install 'nummon[{extra}]'" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_webhook_goes_through_the_environments_http_proxy(tmp_path, endpoints, monkeypatch):
    proxy = endpoints()  # a plain-HTTP proxy receives the absolute URL
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("no_proxy", "")
    monkeypatch.delenv("NO_PROXY", raising=False)
    log = run_log(tmp_path, two_incident_rows()[:50])
    with open(tmp_path / "err.txt", "w") as fh:
        w = Watcher(
            [str(log)], load_policy("default"), [WebhookTarget("http://hooks.example.invalid/services/X")], errors=fh
        )
        w.poll_once(final=True)
        w.close(timeout_s=60)
    assert w.lost == 0 and [p for _, p, _ in proxy.requests] == ["http://hooks.example.invalid/services/X"] * 2
