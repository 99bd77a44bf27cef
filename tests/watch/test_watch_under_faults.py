"""`nummon watch` under faults and odd inputs (misspelt targets, run folders named with a newline
or a non-UTF-8 byte, lock files that are links, a full disk, the webhook target's counters read by
the metrics thread, unreadable and bursting runs, kills, deleted runs) and what it says of the runs
it picks up: real files, real watcher processes and signals, real HTTP receivers."""

import json
import os
import subprocess
import sys
import threading

import pytest
from helpers.watching import (
    WATCH,
    read_events,
    reference_ids,
    slow_writer,
    start_watch,
    stop,
    two_incident_rows,
    wait_for,
    write_lines,
)
from helpers.watching import watch_main as main

from nummon import load_policy
from nummon._watch.settings import WatchSettings
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher

# --- a misspelled target kind never prints the URL's secrets ----------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "slack:https://hooks.slack.com/services/T0SECRET/B0SECRET/tok3nSECRET",
        "Webhook:https://user:pa55SECRET@example.com/hook?token=SECRET",
        "alertmanger:http://admin:SECRETpw@am-0:9093,http://admin:SECRETpw@am-1:9093/SECRET",
        "webhok:user:SECRET@host/x",
    ],
)
def test_a_misspelled_target_kind_names_scheme_and_host_only(tmp_path, capsys, spec):
    assert main([str(tmp_path), "--once", "--notify", spec]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "expected one of" in err
    assert "SECRET" not in err
    kind = spec.split(":", 1)[0]
    assert f"--notify '{kind}:" in err  # the misspelled kind itself is shown
    if "://" in spec:
        assert "://" in err and ("example.com" in err or "hooks.slack.com" in err or "am-0:9093" in err)


def test_a_near_miss_kind_gets_a_hint(tmp_path, capsys):
    assert main([str(tmp_path), "--once", "--notify", "alertmanger:http://am:9093"]) == 2
    assert "did you mean alertmanager:?" in capsys.readouterr().err


# --- run names that are not UTF-8 and hold a newline ------------------------------------------


def _strict_lines(path):
    """Each line of a JSONL file as strict JSON from valid UTF-8 (no bare NaN, no lone surrogate)."""

    def refuse(name):
        raise ValueError(f"bare {name}")

    out = []
    for line in open(path, "rb").read().decode("utf-8").splitlines():
        obj = json.loads(line, parse_constant=refuse)
        json.dumps(obj).encode("utf-8")  # no lone surrogate either
        assert all(c.isprintable() for c in obj["run"]), obj["run"]
        out.append(obj)
    return out


def _runaway_rows():
    rows = two_incident_rows()
    return rows[100:]  # one incident: opened, escalated, non-finite


def test_a_run_folder_named_with_a_newline_and_a_non_utf8_byte_gives_strict_json_events(tmp_path):
    root = os.fsencode(tmp_path / "root")
    odd = os.fsdecode(root + b"/run\n\xff-odd")
    os.makedirs(odd)
    write_lines(os.path.join(odd, "events.jsonl"), _runaway_rows())
    plain = tmp_path / "plain.jsonl"
    write_lines(plain, _runaway_rows())
    notes = tmp_path / "notes.jsonl"
    p = subprocess.run(
        WATCH
        + [
            os.fsdecode(root),
            "--once",
            "--notify",
            f"jsonl:{notes}",
            "--notify",
            "console",
            "--state",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr.decode(errors="replace")[-800:]
    events = _strict_lines(notes)
    assert len(events) == len(reference_ids(plain)) == 3
    assert [e["transition"] for e in events] == ["opened", "escalated", "escalated"]
    assert all(e["run"].endswith("/run\\n\\xff-odd/events.jsonl") for e in events)
    assert len({e["event_id"] for e in events}) == 3


def _shard_of_bytes(rel: bytes, n: int) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(rel).digest()[:8], "big") % n


def test_a_non_utf8_run_name_has_a_shard_and_the_other_runs_nan_is_notified(tmp_path):
    root = tmp_path / "root"
    odd = os.fsdecode(os.fsencode(root) + b"/bad-\xff")
    os.makedirs(odd)
    write_lines(os.path.join(odd, "events.jsonl"), _runaway_rows())
    odd_shard = _shard_of_bytes(b"bad-\xff/events.jsonl", 2)
    # a plain run in the other shard, which loses itself to a NaN
    i = next(i for i in range(100) if _shard_of_bytes(f"ok-{i}/events.jsonl".encode(), 2) != odd_shard)
    (root / f"ok-{i}").mkdir()
    write_lines(root / f"ok-{i}" / "events.jsonl", _runaway_rows())
    got = {}
    for k in range(2):
        notes = tmp_path / f"notes-{k}.jsonl"
        p = subprocess.run(
            WATCH + [str(root), "--once", "--shard", f"{k}/2", "--notify", f"jsonl:{notes}"],
            capture_output=True,
            timeout=300,
        )
        assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr.decode(errors="replace")[-800:]
        got[k] = {e["run"].rsplit("/", 2)[-2] for e in _strict_lines(notes) if e["level"] == 3}
    assert got[odd_shard] == {"bad-\\xff"} and got[1 - odd_shard] == {f"ok-{i}"}


# --- a symlinked state.json.lock is refused, its target untouched -----------------------------


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    write_lines(log, two_incident_rows()[:20])
    precious = tmp_path / "precious.txt"
    precious.write_text("do not truncate me\n")
    state = tmp_path / "state.json"
    os.symlink(precious, f"{state}.lock")
    assert main([str(log), "--once", "--state", str(state), "--notify", f"jsonl:{tmp_path / 'n.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "symbolic link" in err and "Traceback" not in err
    assert precious.read_text() == "do not truncate me\n"
    assert os.path.islink(f"{state}.lock") and not state.exists()


def test_a_dangling_lock_link_is_refused_and_nothing_is_created(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    write_lines(log, two_incident_rows()[:20])
    state = tmp_path / "state.json"
    os.symlink(tmp_path / "elsewhere.pid", f"{state}.lock")
    assert main([str(log), "--once", "--state", str(state)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere.pid").exists()


# --- the JSONL event record on a full disk ----------------------------------------------------

FSIZE_LIMITED = r"""
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail with EFBIG, as on a full disk
from nummon._cli import main
sys.exit(main(["watch", *sys.argv[2:]]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_event_record_on_a_full_disk_never_tears_a_line_and_reports_each_event_not_written(tmp_path):
    log = tmp_path / "run.jsonl"
    write_lines(log, _runaway_rows())
    full = tmp_path / "full.jsonl"  # what the three events take without a limit
    p = subprocess.run(
        WATCH + [str(log), "--once", "--notify", f"jsonl:{full}"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    sizes = [len(line) for line in full.read_bytes().splitlines(keepends=True)]
    assert len(sizes) == 3
    limit = sizes[0] + sizes[1] // 2  # the first event fits, the second is cut halfway, the third has no room
    notes = tmp_path / "notes.jsonl"
    p = subprocess.run(
        [sys.executable, "-c", FSIZE_LIMITED, str(limit), str(log), "--once", "--notify", f"jsonl:{notes}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in p.stderr
    events = _strict_lines(notes)  # every line whole: no torn one
    assert notes.read_bytes().endswith(b"\n") and [e["transition"] for e in events] == ["opened"]
    assert p.returncode == 1  # --once: notifications were lost
    lost = [line for line in p.stderr.splitlines() if "lost" in line or "could not deliver" in line]
    assert lost and "2 notifications" in p.stderr, p.stderr  # the two events not written are counted, not delivered


# --- thread safety: the webhook target's counters, read by the metrics scrape thread ----------


class _CountingEndpoint:
    """127.0.0.1: holds every request until `release` is set, then answers 200, and 400 to every
    fourth request (a final refusal: counted failed)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.release = threading.Event()
        self.n = 0
        lock = threading.Lock()
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                me.release.wait(60)
                with lock:
                    me.n += 1
                    k = me.n
                self.send_response(400 if k % 4 == 0 else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _counts(t):
    """sent, failed, dropped, queued and in flight, as one scrape sees them."""
    if hasattr(t, "stats"):
        s = t.stats()
        return s.sent, s.failed, s.dropped, s.queued, s.in_flight + s.unsent
    return t.sent, t.failed, t.dropped, t._queue.qsize(), int(t._in_flight is not None)  # before: field by field


def test_webhook_counters_are_consistent_for_a_scrape_thread_under_fast_switching():
    from nummon._watch.metrics import FleetMetrics
    from nummon._watch.notices import Notice
    from nummon._watch.webhook import WebhookTarget

    ep = _CountingEndpoint()
    t = WebhookTarget(ep.url, retries=0, queue_size=1000, on_outcome=lambda o: None)
    fleet = FleetMetrics()
    fleet.targets = [t]
    n = 120
    for i in range(n):
        t.on_incident(Notice.from_dict({"id": f"r#{i}:opened:1", "run": "r", "title": f"event {i}", "summary": "s"}))
    wrong, scrapes = [], [0]
    done = threading.Event()

    def scrape():
        while not done.is_set():
            c = _counts(t)
            fleet.snapshot()  # the metrics' own read of `failed`
            scrapes[0] += 1
            if sum(c) != n:
                wrong.append(c)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        scraper = threading.Thread(target=scrape)
        scraper.start()
        ep.release.set()
        wait_for(lambda: _counts(t)[0] + _counts(t)[1] == n, timeout=120, what="every event answered")
        done.set()
        scraper.join(30)
    finally:
        sys.setswitchinterval(old)
        t.close(timeout_s=1)
        ep.close()
    assert scrapes[0] > 100
    assert not wrong, f"{len(wrong)} of {scrapes[0]} scrapes saw counts that do not add up to {n}, e.g. {wrong[:3]}"
    assert _counts(t) == (n - n // 4, n // 4, 0, 0, 0)


# --- watch names each run it picks up and says when it stops ----------------------------------


def test_watch_names_each_run_it_picks_up_and_its_stop_with_true_numbers(tmp_path):
    root = tmp_path / "root"
    (root / "first").mkdir(parents=True)
    rows = two_incident_rows()
    write_lines(root / "first" / "events.jsonl", rows)
    notes = tmp_path / "notes.jsonl"
    proc = start_watch(root, "--interval", "0.2", "--notify", f"jsonl:{notes}")
    try:
        wait_for(lambda: len(read_events(notes)) == 6, what="the first run's events")
        (root / "later").mkdir()
        write_lines(root / "later" / "events.jsonl", rows[:50])
        wait_for(lambda: len(read_events(notes)) == 8, what="the later run's events")
    finally:
        rc, out, err = stop(proc)
    lines = [line[len("nummon watch: ") :] for line in err.splitlines()]
    assert rc == 0 and lines[0].startswith("watching 1 run under ")
    assert lines[1] == "  run first/events.jsonl (jsonl)"
    assert lines.count("new run later/events.jsonl (jsonl): watched from now on") == 1
    n_events = len(reference_ids(root / "first" / "events.jsonl")) + len(reference_ids(root / "later" / "events.jsonl"))
    assert lines[-1] == (
        f"stopped (SIGTERM): 2 runs watched, {len(rows) + 50} records read, "
        f"{n_events} incident events notified ({n_events} delivered)"
    )


@pytest.mark.slow
def test_watch_once_ends_with_its_summary_and_counts_what_was_lost(tmp_path):
    log = tmp_path / "run.jsonl"
    write_lines(log, _runaway_rows())
    p = subprocess.run(
        WATCH + [str(log), "--once", "--notify", "webhook:http://127.0.0.1:9/hook"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # port 9: nothing listens, every post refused
    last = p.stderr.splitlines()[-1]
    assert p.returncode == 1
    assert last == (
        f"nummon watch: stopped (the --once pass is done): 1 run watched, {len(_runaway_rows())} records read, "
        "3 incident events notified (0 delivered, 3 notifications lost)"
    )


# --- one unreadable JSONL in the root is that run's problem only ------------------------------


def _without_file_capabilities():
    """preexec_fn: as root, drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set,
    so the exec'ed watcher has no power over file modes (a `chmod 000` file is unreadable to
    it, as to any other user); as anyone else, nothing to do."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(97)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file capabilities as on Linux")
def test_an_unreadable_jsonl_is_that_runs_problem_and_the_other_runs_nan_is_notified(tmp_path):
    root = tmp_path / "root"
    (root / "secret").mkdir(parents=True)
    (root / "readable").mkdir()
    write_lines(root / "secret" / "events.jsonl", _runaway_rows())
    write_lines(root / "readable" / "events.jsonl", _runaway_rows())
    os.chmod(root / "secret" / "events.jsonl", 0)
    notes = tmp_path / "notes.jsonl"
    proc = subprocess.Popen(
        WATCH + [str(root), "--interval", "0.2", "--notify", f"jsonl:{notes}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_without_file_capabilities,
    )
    try:
        wait_for(
            lambda: proc.poll() is not None or any(e["level"] == 3 for e in read_events(notes)),
            what="the readable run's NaN",
        )
        if proc.poll() == 97:
            pytest.skip("cannot drop root's file capabilities here")
        wait_for(lambda: proc.poll() is not None or len(read_events(notes)) >= 3, timeout=5, what="a few polls more")
        import time

        time.sleep(1.0)  # five more polls: the problem is not said again
    finally:
        rc, out, err = stop(proc)
    assert rc == 0 and "Traceback" not in err, err[-800:]
    events = read_events(notes)
    assert {e["run_name"] for e in events} == {"readable/events.jsonl"} and len(events) == 3
    said = [line for line in err.splitlines() if "secret/events.jsonl" in line]
    assert len(said) == 1 and "Permission denied" in said[0], err


# --- a run whose log grows by a lot is read in bounded chunks, fairly -------------------------


def _healthy(n, start=0):
    import math

    return [
        {
            "type": "step",
            "step": s,
            "loss": 2.0 * 0.999**s * (1 + 0.03 * math.sin(1.3 * s)),
            "grad_norm": 1 + 0.1 * math.sin(s),
            "pad": "x" * 200,
        }
        for s in range(start, start + n)
    ]


def _bounded_watcher(root, tmp_path, poll_bytes, monkeypatch):
    notes = tmp_path / "notes.jsonl"
    w = Watcher(
        [str(root)],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(exclude=frozenset({str(notes)}), poll_bytes=poll_bytes),
        errors=open(tmp_path / "err", "a"),
    )
    return w, notes


@pytest.mark.slow
def test_a_burst_in_one_run_is_read_in_bounded_chunks_and_the_other_runs_go_first(tmp_path, monkeypatch):
    root = tmp_path / "root"
    for name in ("big", "small", "third"):
        (root / name).mkdir(parents=True)
        write_lines(root / name / "events.jsonl", _healthy(40))
    bound = 64 * 1024
    w, notes = _bounded_watcher(root, tmp_path, bound, monkeypatch)
    try:
        w.poll_once()
        big = w.runs[str(root / "big" / "events.jsonl")]
        write_lines(root / "big" / "events.jsonl", _healthy(12000, start=40), mode="a")  # about 3 MB at once
        rows = _runaway_rows()
        for r in rows:
            r["step"] += 40
        write_lines(root / "small" / "events.jsonl", rows, mode="a")
        size = (root / "big" / "events.jsonl").stat().st_size
        assert size > 40 * bound
        passes, nonfinite_at, _third_at = 0, {}, None
        while True:
            before = big.follower.offset
            w.poll_once()
            passes += 1
            assert big.follower.offset - before <= bound, (
                f"pass {passes} read {big.follower.offset - before} bytes of one run"
            )
            for e in read_events(notes):
                if e["level"] == 3:
                    nonfinite_at.setdefault(e["run_name"], passes)
            if passes == 2:  # the third run loses itself while the big one is still being read
                bad = _runaway_rows()
                for r in bad:
                    r["step"] += 40
                write_lines(root / "third" / "events.jsonl", bad, mode="a")
            if big.follower.offset == size:
                break
            assert passes < 200
        assert nonfinite_at == {"small/events.jsonl": 1, "third/events.jsonl": 3}
        assert passes >= (size - 40 * 250) // bound  # the backlog took its many passes
        assert big.records == 12040
    finally:
        w.close()


# --- SIGKILL every second while the run writes: every event exactly once ----------------------


KILLS = 12  # SIGKILLs of the watcher per run of the test below


@pytest.mark.slow
def test_a_watcher_sigkilled_every_second_while_its_run_writes_notifies_each_event_exactly_once(tmp_path):
    import signal
    import time

    from helpers import webhook_receiver

    rows = two_incident_rows()
    full = tmp_path / "full.jsonl"
    write_lines(full, rows)
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    log.touch()
    writer = slow_writer(full, log, pause_s=0.06)
    receiver = webhook_receiver.Receiver()
    state, notes = tmp_path / "state.json", tmp_path / "notes.jsonl"
    args = (
        tmp_path / "run",
        "--interval",
        "0.1",
        "--state",
        state,
        "--notify",
        f"jsonl:{notes}",
        "--notify",
        f"webhook:{receiver.url}",
    )
    kills, progress = 0, []
    delays = iter([0.4, 1.0, 0.2, 0.7, 0.5, 0.9, 0.3, 0.6] * 10)  # within a second of its start, at varied points
    try:
        while writer.poll() is None or kills < KILLS:
            watcher = start_watch(*args)
            watcher.stderr.readline()  # "watching 1 run ...": imports done, the first pass under way
            time.sleep(next(delays))
            watcher.send_signal(signal.SIGKILL)  # no cleanup at all, wherever it is
            watcher.communicate(timeout=30)
            kills += 1
            if state.exists():
                progress.append(json.loads(state.read_text())["runs"].get(str(log.resolve()), {}).get("records", 0))
        watcher = start_watch(*args)
        watcher.stderr.readline()  # its signal handlers are in place
        expect = reference_ids(log)
        wait_for(
            lambda: len(read_events(notes)) >= len(expect) and len(receiver.bodies) >= len(expect),
            what="every event after the last restart",
        )
        rc, out, err = stop(watcher)
    finally:
        writer.kill()
        receiver.close()
    assert kills >= 3 and rc == 0, err
    assert len(set(progress)) >= 2 and 0 < min(progress) < len(rows)  # killed watchers had read part of the run
    once = tmp_path / "once.jsonl"
    p = subprocess.run(
        WATCH + [str(log), "--once", "--notify", f"jsonl:{once}"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    reference = [e["id"] for e in read_events(once)]
    assert [e["id"] for e in read_events(notes)] == reference == expect  # none lost, none twice
    got = [b["nummon"]["id"] for b in receiver.bodies]
    assert sorted(set(got)) == sorted(reference)  # every event at the webhook; a resend keeps its event_id
    assert len({b["event_id"] for b in receiver.bodies}) == len(reference)
    # each post carries its event's id in a header too, so a receiver drops a repeat unread; each
    # delivery is journalled before the next post, so only a post in flight at a kill is repeated
    assert receiver.event_ids == [b["event_id"] for b in receiver.bodies]
    duplicates = len(receiver.bodies) - len(reference)
    print(f"{kills} kills: {len(receiver.bodies)} posts for {len(reference)} events, {duplicates} duplicates")
    assert kills >= KILLS and duplicates <= kills // 4, (kills, duplicates)


def test_an_event_record_left_mid_line_by_a_crash_gets_its_next_event_on_a_line_of_its_own(tmp_path):
    log = tmp_path / "run.jsonl"
    write_lines(log, _runaway_rows())
    notes = tmp_path / "notes.jsonl"
    notes.write_bytes(b'{"type": "incident", "id": "torn by a crash')  # no newline: a writer killed mid-line
    p = subprocess.run(
        WATCH + [str(log), "--once", "--notify", f"jsonl:{notes}"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    lines = notes.read_bytes().splitlines()
    assert lines[0].startswith(b'{"type": "incident", "id": "torn') and len(lines) == 4
    assert [json.loads(line)["transition"] for line in lines[1:]] == ["opened", "escalated", "escalated"]


# --- runs deleted from the root are forgotten after a grace period ----------------------------


def test_runs_deleted_from_the_root_are_forgotten_after_the_grace_period_across_restarts(tmp_path):
    import shutil
    import time

    root = tmp_path / "root"
    for i in range(100):
        (root / f"run-{i}").mkdir(parents=True)
        write_lines(root / f"run-{i}" / "events.jsonl", _healthy(20))
    (root / "alive").mkdir()
    write_lines(root / "alive" / "events.jsonl", _healthy(20))
    state = tmp_path / "state.json"
    err = open(tmp_path / "err", "a")
    grace = 3600.0

    def session(clock):
        w = Watcher(
            [str(root)],
            load_policy("default"),
            [],
            settings=WatchSettings(state_path=str(state), forget_after_s=grace),
            errors=err,
        )
        w.wall_clock = lambda: clock
        try:
            w.poll_once()
            w.poll_once()
        finally:
            w.close()
        return json.loads(state.read_text())["runs"]

    t0 = time.time()
    assert len(session(t0)) == 101
    for i in range(100):
        shutil.rmtree(root / f"run-{i}")
    size_before = state.stat().st_size
    assert len(session(t0 + 60)) == 101  # gone for a minute: kept (a log being replaced, a share remounted)
    assert len(session(t0 + grace - 1)) == 101  # a restart keeps when they went
    runs = session(t0 + 60 + grace)  # gone for the whole grace period: forgotten
    assert list(runs) == [str(root / "alive" / "events.jsonl")]
    assert state.stat().st_size < size_before / 20
    said = [line for line in (tmp_path / "err").read_text().splitlines() if "forgot" in line]
    assert said == [
        "nummon watch: forgot 100 runs whose files are gone for 1 h or more (e.g. run-0/events.jsonl); "
        "read from the start if they come back"
    ]


def test_runs_under_a_root_that_is_away_are_never_forgotten(tmp_path):
    root = tmp_path / "share"
    (root / "run").mkdir(parents=True)
    write_lines(root / "run" / "events.jsonl", _healthy(20))
    state = tmp_path / "state.json"
    w = Watcher(
        [str(root)],
        load_policy("default"),
        [],
        settings=WatchSettings(state_path=str(state), forget_after_s=0.0),
        errors=open(os.devnull, "w"),
    )
    w.poll_once()
    w.close()
    (root / "run" / "events.jsonl").rename(tmp_path / "away.jsonl")
    os.rmdir(root / "run")
    os.rmdir(root)  # the whole share unmounted
    w = Watcher(
        [str(root)],
        load_policy("default"),
        [],
        settings=WatchSettings(state_path=str(state), forget_after_s=0.0),
        errors=open(os.devnull, "w"),
    )
    w.poll_once()
    w.close()
    assert list(json.loads(state.read_text())["runs"]) == [str(root / "run" / "events.jsonl")]
