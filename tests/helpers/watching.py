"""The watcher as a subprocess and the logs it reads: start and stop `python -m nummon._watch`,
write JSONL step rows, read its event log, wait for a condition."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.checkout import ROOT
from nummon import load_policy
from nummon._core.json import dumps
from nummon._watch import make_follower
from nummon._watch.runs import WatchedRun

WATCH = [sys.executable, "-m", "nummon", "watch"]


def two_incident_rows():
    """A run that runs away and recovers (incident 1: opened, escalated, resolved), then runs
    away into NaN (incident 2: opened, escalated, escalated to non-finite)."""
    out = []
    for s in range(130):
        if 40 <= s < 45:
            loss, g = 2.0 * 4 ** (s - 39), 2.0 ** (s - 39)
        elif s >= 120:
            loss, g = 1.0 * 4 ** (s - 119), 2.0 ** (s - 119)
        else:
            loss, g = 2.0 * 0.99**s * (1 + 0.03 * math.sin(1.3 * s)), 1 + 0.1 * math.sin(s)
        out.append({"type": "step", "step": s, "loss": loss, "grad_norm": g})
    out.append({"type": "step", "step": 130, "loss": math.nan, "grad_norm": math.inf})
    return out


def write_lines(path, rows, mode="w"):
    with open(path, mode) as fh:
        for r in rows:
            fh.write(dumps(r) + "\n")


def reference_ids(path):
    """Incident event ids the detectors give over the whole finished log, in-process."""
    run = WatchedRun(str(Path(path).resolve()), make_follower(str(path)), load_policy("default"))
    return [e.id for e in run.poll(final=True)]


def read_events(path):
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def wait_for(cond, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start_watch(*args, cwd=None):
    return subprocess.Popen(
        WATCH + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT
    )


def stop(proc, sig=signal.SIGTERM):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def watch_main(argv):
    """`nummon watch ARGV...` in this process, through the CLI's one front end: its exit status
    (a usage error's 2 included, as a shell would see it)."""
    from nummon._cli import main

    try:
        return main(["watch", *argv])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2


def slow_writer(src, dst, pause_s):
    """A child process appending `src`'s lines to `dst` one at a time, `pause_s` seconds apart
    (a run writing its log while the watcher reads it); the caller waits for it or kills it."""
    script = (
        "import sys, time\n"
        "src, dst, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
        "with open(dst, 'a') as out:\n"
        "    for line in open(src):\n"
        "        out.write(line); out.flush(); time.sleep(pause)\n"
    )
    return subprocess.Popen([sys.executable, "-c", script, str(src), str(dst), str(pause_s)])
