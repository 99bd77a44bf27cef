"""The alert path under faults: stuck and failing sinks, killed processes, threads, strict JSON."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from torch import nn

import nummon
from nummon import JsonlSink, MemorySink, Monitor, NummonError, Severity

RUNAWAY = [2.0] * 12 + [2.0 * 8**k for k in range(1, 6)] + [float("nan")]  # critical, then NaN


def _strict(line):
    def refuse(name):
        raise ValueError(f"bare {name} in the event log")

    return json.loads(line, parse_constant=refuse)


class SlowAlertJsonl(JsonlSink):
    """A JSONL log whose alert writes are slow (a busy disk)."""

    def on_alert(self, alert):
        time.sleep(0.3)
        super().on_alert(alert)


def test_critical_alert_and_its_step_are_on_disk_when_post_step_returns(tmp_path):
    log = tmp_path / "events.jsonl"
    mon = Monitor(sinks=[SlowAlertJsonl(log)], policy={"alerts": {"stop_on_critical": False}})
    checked = 0
    for loss in RUNAWAY:
        report = mon.post_step(loss)
        if any(a.severity is Severity.CRITICAL for a in report.alerts):
            lines = [_strict(l) for l in log.read_text().splitlines()]
            crit = [l for l in lines if l["type"] == "alert" and l["severity"] == "critical"]
            assert crit and crit[-1]["step"] == report.step
            assert any(l["type"] == "step" and l["step"] == report.step for l in lines)
            checked += 1
    mon.close()
    assert checked >= 2  # the runaway's critical alert and the NaN's: the checks above ran


class GatedSink(nummon.BaseSink):
    """A notifying sink (W&B, a webhook) that cannot deliver until the test lets it."""

    def __init__(self):
        self.release = threading.Event()
        self.alerts = []

    def on_alert(self, alert):
        self.release.wait(60)
        self.alerts.append(alert)


def test_a_critical_alert_waits_for_the_event_log_only_not_for_slow_notifying_sinks(tmp_path, caplog):
    log, gated = tmp_path / "events.jsonl", GatedSink()
    mon = Monitor(
        sinks=[gated, JsonlSink(log)],
        policy={"alerts": {"stop_on_critical": False}, "sinks": {"critical_timeout_s": 2.0}},
    )
    report = next(r for r in map(mon.post_step, RUNAWAY) if any(a.severity is Severity.CRITICAL for a in r.alerts))
    # post_step returned while the gated sink still holds the alert: nobody waited for it ...
    assert not any("did not write within" in r.message for r in caplog.records)
    assert not gated.alerts
    # ... and the durable event log has it on disk
    crit = [
        e for e in map(_strict, log.read_text().splitlines()) if e["type"] == "alert" and e["severity"] == "critical"
    ]
    assert [e["step"] for e in crit] == [report.step]
    gated.release.set()
    mon.close()
    assert any(a.severity is Severity.CRITICAL and a.step == report.step for a in gated.alerts)  # delivered, not lost


def test_a_loss_beyond_float_range_is_a_one_line_error_and_changes_nothing():
    mon = Monitor()
    with pytest.raises(NummonError) as err:
        mon.post_step(10**400)
    assert "\n" not in str(err.value) and "float" in str(err.value)
    with pytest.raises(NummonError):
        mon.post_step(1.0, clip_norm=10**400)
    assert mon.post_step(1.0).step == 0  # nothing changed
    mon.close()


FULL_DISK = """
import resource, signal
from nummon import Monitor
mon = Monitor(run_dir="run", policy={"alerts": {"stop_on_critical": False}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))
for loss in [2.0] * 40 + [float("nan")]:
    mon.post_step(loss)
mon.close()
print("FLIGHT RECORD", mon.flight_record)
"""


@pytest.mark.slow
def test_a_flight_record_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    (tmp_path / "train.py").write_text(FULL_DISK)
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "could not write the flight record" in out.stderr  # the write was tried, and failed
    assert "FLIGHT RECORD None" in out.stdout
    assert list(tmp_path.rglob("*.tmp")) == [] and list((tmp_path / "run").iterdir()) == []


@pytest.mark.slow
def test_a_flight_record_that_cannot_be_written_is_said_once_for_its_folder(tmp_path):
    # three incidents, each critical, in a folder where no flight record fits: one warning, not three
    healthy = "[2.0 * 0.999**i * (1 + 0.01 * ((i * 7) % 5)) for i in range(150)]"
    script = FULL_DISK.replace('[2.0] * 40 + [float("nan")]', f'({healthy} + [float("nan")]) * 3').replace(
        'print("FLIGHT RECORD", mon.flight_record)', 'print("INCIDENTS", max(e.number for e in mon.incidents))'
    )
    (tmp_path / "train.py").write_text(script)
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "INCIDENTS 3" in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.count("could not write the flight record") == 1, out.stderr


def test_event_log_and_flight_record_are_strict_json(tmp_path):
    mon = Monitor(sinks=[JsonlSink(tmp_path / "e.jsonl")], policy={"alerts": {"stop_on_critical": False}})
    for loss in RUNAWAY:
        mon.post_step(loss)
    mon.close()
    lines = [_strict(l) for l in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert lines[-1]["type"] == "step" and lines[-1]["loss"] == "NaN"
    assert mon.flight_record is not None
    record = _strict(mon.flight_record.read_text())
    assert record["alert"]["severity"] == "critical"
    # nummon reads its own strict log back
    rec = list(nummon.read_trace(tmp_path / "e.jsonl"))
    assert any(r.loss != r.loss for r in rec)


def test_default_flight_record_goes_next_to_the_jsonl_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mon = Monitor(sinks=[JsonlSink("runs/e.jsonl")])
    for loss in RUNAWAY:
        if mon.post_step(loss).should_stop:
            break
    mon.close()
    assert mon.flight_record is not None
    assert mon.flight_record.parent.resolve() == (tmp_path / "runs").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the working folder


def test_without_any_folder_the_flight_record_goes_to_a_new_run_folder(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    mon = Monitor()
    for loss in RUNAWAY:
        mon.post_step(loss)
    mon.close()
    assert (
        mon.flight_record.parent.parent == tmp_path / "nummon-runs"
        or mon.flight_record.parent.parent.resolve() == (tmp_path / "nummon-runs").resolve()
    )
    assert sum("no run folder given" in r.message for r in caplog.records) == 1


def test_healthy_run_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mon = Monitor()
    for i in range(
        20
    ):  # a healthy loss (a constant one is a frozen-loss stall: an incident, whose report has a folder)
        mon.post_step(2.0 * 0.98**i * (1 + 0.02 * (-1) ** i))
    mon.close()
    assert mon.incidents == [] and list(tmp_path.iterdir()) == []


class StuckSink(nummon.BaseSink):
    def __init__(self):
        self.release = threading.Event()

    def on_step(self, record, health):
        self.release.wait(60)

    def close(self):
        self.release.wait(60)


class ClosingMemorySink(MemorySink):
    def __init__(self):
        super().__init__()
        self.closed_event = threading.Event()

    def close(self):
        super().close()
        self.closed_event.set()


def test_a_stuck_sink_bounds_block_mode_waits_and_close(caplog):
    stuck, mem = StuckSink(), ClosingMemorySink()
    # the stuck sink never makes room and never closes, so both bounded waits run out whatever the load
    pol = {
        "sinks": {"queue_size": 2, "when_full": "block", "block_timeout_s": 0.2, "close_timeout_s": 0.5},
        "alerts": {"stop_on_critical": False},
    }
    mon = Monitor(sinks=[stuck, mem], policy=pol)
    for loss in RUNAWAY:
        mon.post_step(loss)
    mon.close()  # returns although the stuck sink never closes
    assert mon.sink_stats["StuckSink"]["dropped"] > 0
    messages = " ".join(r.message for r in caplog.records)
    assert "block_timeout_s" in messages and "close_timeout_s" in messages
    assert mem.closed_event.wait(60)  # the healthy sink closes on its own thread, however slow the machine
    assert len(mem.records) == len(RUNAWAY)  # and got everything
    stuck.release.set()


class ExitingSink(nummon.BaseSink):
    def __init__(self):
        self.calls = 0

    def on_step(self, record, health):
        self.calls += 1
        raise SystemExit(3)


def test_a_sink_raising_systemexit_is_isolated_and_keeps_its_thread():
    bad = ExitingSink()
    mon = Monitor(sinks=[bad])
    for _ in range(5):
        mon.post_step(1.0)
    mon.close()
    assert bad.calls == 5 and mon.sink_stats["ExitingSink"]["errors"] == 5


def test_two_sinks_of_one_class_have_their_own_stats(tmp_path):
    mon = Monitor(sinks=[JsonlSink(tmp_path / "a.jsonl"), JsonlSink(tmp_path / "b.jsonl")])
    mon.post_step(1.0)
    mon.close()
    assert set(mon.sink_stats) == {"JsonlSink", "JsonlSink#2"}


def test_post_step_from_two_threads_gives_unique_steps():
    mem = MemorySink()
    mon = Monitor(sinks=[mem])
    reports = []

    def worker():
        for _ in range(100):
            reports.append(mon.post_step(1.0).step)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mon.close()
    assert sorted(reports) == list(range(200))
    assert sorted(r.step for r in mem.records) == list(range(200))


@pytest.mark.parametrize("loss", [np.complex128(1 + 2j), np.complex64(1)])
def test_complex_numpy_losses_are_rejected(loss):
    mon = Monitor()
    with pytest.raises(NummonError, match="real number"):
        mon.post_step(loss)
    assert mon.post_step(1.0).step == 0  # nothing changed
    mon.close()


class _DoneEvent:
    """Stands in for a CUDA event that has completed (this machine has no GPU)."""

    def query(self):
        return True

    def synchronize(self):
        pass


def test_lagged_mode_first_report_is_pending_and_no_step_is_reported_twice():
    mem = MemorySink()
    mon = Monitor(sinks=[mem])
    launch = mon._stats.launch

    def lagged_launch(*a, **k):
        p = launch(*a, **k)
        p.event = _DoneEvent()
        return p

    mon._stats.launch = lagged_launch
    reports = [mon.post_step(float(i + 1)) for i in range(4)]
    assert reports[0].pending and reports[0].health is None and reports[0].record is None
    evaluated = [r.step for r in reports if not r.pending]
    final = mon.flush()
    evaluated.append(final.step)
    mon.close()
    assert evaluated == [0, 1, 2, 3]
    assert [r.step for r in mem.records] == [0, 1, 2, 3]


def test_jsonl_rank_comes_from_the_monitors_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "7")  # a stale variable: the group says rank 0
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mon = Monitor(nn.Linear(2, 1), sinks=[JsonlSink(tmp_path / "e-{rank}.jsonl")])
        mon.post_step(1.0)
        mon.close()
    finally:
        dist.destroy_process_group()
    # the event log is named for the group's rank (beside it: the run's report, written at close)
    assert [p.name for p in tmp_path.glob("*.jsonl")] == ["e-0.jsonl"]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_wandb_explicit_mode_with_wandb_mode_set(wandb_env):
    from nummon.integrations.wandb import WandbSink

    sink = WandbSink(project="nummon-test", mode="offline")  # WANDB_MODE=offline is set too
    assert sink.offline
    sink.close()


@pytest.mark.slow
def test_wandb_bogus_mode_is_one_line_and_online_without_key_goes_offline(wandb_env, monkeypatch, caplog):
    from nummon.integrations.wandb import WandbSink

    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(NummonError, match="'bogus'"):
        WandbSink(project="nummon-test")
    monkeypatch.setenv("WANDB_MODE", "online")
    sink = WandbSink(project="nummon-test")
    assert sink.offline
    assert any("needs an API key" in r.message for r in caplog.records)
    sink.close()


# ------------------------------------------------------------------ real processes, real signals

SCRIPT = """
import sys, time, torch
from torch import nn
from nummon import Monitor, JsonlSink
mode = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(64, 8) * 2, torch.randn(64, 1)
mon = Monitor(model, opt, sinks=[JsonlSink("events.jsonl")], policy={"alerts": {"stop_on_critical": False}})
for step in range(200):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    r = mon.post_step(loss)
    if mode == "kill" and any(a.severity.value == "critical" for a in r.alerts):
        print("CRITICAL", r.step, flush=True)
        time.sleep(60)
    if mode == "term" and step == 30:
        print("STEP", r.step, flush=True)
        time.sleep(60)
    if mode == "exit" and r.health.value == "nonfinite":
        print("NONFINITE", r.step, flush=True)
        break
"""


def _run_script(tmp_path, mode, sig=None):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen([sys.executable, "train.py", mode], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if sig is not None:
        os.kill(proc.pid, sig)
    proc.wait(timeout=120)
    events = [_strict(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    return proc.returncode, int(line[1]), events


@pytest.mark.slow
def test_sigkill_after_a_critical_alert_leaves_it_and_every_step_on_disk(tmp_path):
    rc, step, events = _run_script(tmp_path, "kill", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert any(e["type"] == "alert" and e["severity"] == "critical" and e["step"] == step for e in events)
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(step + 1))


@pytest.mark.slow
def test_sigterm_flushes_the_event_log_then_dies_of_sigterm(tmp_path):
    rc, step, events = _run_script(tmp_path, "term", signal.SIGTERM)
    assert rc == -signal.SIGTERM
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(step + 1))


@pytest.mark.slow
def test_a_script_that_never_closes_still_logs_its_last_nonfinite_step(tmp_path):
    rc, step, events = _run_script(tmp_path, "exit")
    assert rc == 0
    last = [e for e in events if e["type"] == "step"][-1]
    assert last["step"] == step and last["health"] == "nonfinite"
