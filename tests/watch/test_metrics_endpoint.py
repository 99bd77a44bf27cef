"""The /metrics endpoint under hostile conditions: a run folder whose name is not UTF-8, and a
flood of half-open connections against a watcher whose file descriptors are few (the watcher's
own work, reading a run's NaN and notifying it, must not starve)."""

import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers.checkout import ROOT

pytest.importorskip("prometheus_client")
from helpers.prometheus_servers import wait_for  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nummon import load_policy
from nummon._core.json import dumps  # noqa: E402
from nummon._watch.metrics import FleetMetrics, MetricsObserver  # noqa: E402
from nummon._watch.watcher import Watcher  # noqa: E402
from nummon.integrations.prometheus import label_value, serve_metrics  # noqa: E402


def step_lines(steps, nan_at=None):
    return "".join(
        dumps({"type": "step", "step": s, "loss": math.nan if s == nan_at else 2.0 - 0.01 * s, "grad_norm": 1.0}) + "\n"
        for s in steps
    )


def test_a_run_folder_named_with_a_non_utf8_byte_is_served_escaped(tmp_path):
    root = tmp_path / "runs"
    odd = os.path.join(os.fsencode(root), b"run-\xff")
    os.makedirs(odd)
    with open(os.path.join(odd, b"events.jsonl"), "w") as fh:
        fh.write(step_lines(range(20)))
    (root / "plain").mkdir()
    (root / "plain" / "events.jsonl").write_text(step_lines(range(20)))
    fleet = FleetMetrics()
    server = serve_metrics(fleet, "127.0.0.1:0")
    watcher = Watcher(
        [str(root)], load_policy("default"), [], observer=MetricsObserver(fleet), errors=open(os.devnull, "w")
    )
    try:
        watcher.poll_once()
        with urllib.request.urlopen(server.url, timeout=5) as r:
            assert r.status == 200
            text = r.read().decode("utf-8")
        runs = {
            s.labels["run"] for fam in text_string_to_metric_families(text) for s in fam.samples if "run" in s.labels
        }
        assert runs == {
            str(root / "plain" / "events.jsonl"),
            str(root) + "/run-\\xff/events.jsonl",
        }  # both, the byte escaped
    finally:
        watcher.close()
        server.close()


@pytest.mark.parametrize("name, shown", [("run-\udcff", "run-\\xff"), ("é", "é"), ("bad-\ud800", "bad-\\ud800")])
def test_label_values_are_always_utf8(name, shown):
    assert label_value(name) == shown
    label_value(name).encode("utf-8")


# the watcher, in a process of its own with few file descriptors (as under the usual 1,024, scaled down)
WATCHER = r"""
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (96, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from nummon._policy.policy import load_policy
from nummon._watch.metrics import FleetMetrics, MetricsObserver
from nummon._watch.targets import parse_target
from nummon._watch.watcher import Watcher
from nummon.integrations.prometheus import serve_metrics
root, notes = sys.argv[1], sys.argv[2]
fleet = FleetMetrics()
server = serve_metrics(fleet, "127.0.0.1:0", max_connections=8, idle_timeout_s=1.0)
print("serving", server.url, flush=True)
w = Watcher([root], load_policy("default"), [parse_target("jsonl:" + notes)], observer=MetricsObserver(fleet))
try:
    w.run(interval_s=0.1)
except KeyboardInterrupt:
    pass
"""


@pytest.mark.slow
def test_half_open_connections_never_starve_the_watcher(tmp_path):
    log = tmp_path / "runs" / "a" / "events.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(step_lines(range(40)))
    notes = tmp_path / "notes.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(tmp_path / "runs"), str(notes)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = []
    try:
        url = re.search(r"serving (\S+)", proc.stdout.readline()).group(1)
        host, port = re.search(r"//([\d.]+):(\d+)/", url).groups()
        # 150 clients connect and say nothing (more than the watcher's 96 descriptors)
        for _ in range(150):
            s = socket.create_connection((host, int(port)), timeout=5)
            held.append(s)
        time.sleep(0.3)
        # while they are held, the run goes NaN: the watcher reads it and notifies it
        with open(log, "a") as fh:
            fh.write(step_lines([40], nan_at=40))
        wait_for(
            lambda: notes.exists() and "nonfinite" in notes.read_text(),
            30,
            "the NaN notified while connections are held",
        )
        assert proc.poll() is None
        # idle connections are timed out: a scrape gets through while the 150 clients stay connected
        body = wait_for(lambda: urllib.request.urlopen(url, timeout=2).read().decode(), 30, "a scrape to get through")
        assert "nummon_incident_state" in body
    finally:
        for s in held:
            s.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Too many open files" not in err, err[-2000:]
