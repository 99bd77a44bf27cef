"""Sinks with the real libraries: TensorBoard event files and server, W&B offline run files,
failure isolation, install hints. One contract suite runs over every sink."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers.models import runaway_run
from helpers.wandb_reader import alerts as wb_alerts
from helpers.wandb_reader import find_run_file, history_rows, read_records
from torch import nn

import nummon
from nummon import Alert, AlertKind, Health, JsonlSink, Monitor, Severity

HIST_EVERY = 10
POLICY = {"sampling": {"histogram_every": HIST_EVERY}, "alerts": {"stop_on_critical": False}}


def first_nonfinite(reports):
    return next(r.step for r in reports if r.health is Health.NONFINITE)


@pytest.mark.slow
def test_tensorboard_and_wandb_receive_scalars_histograms_and_alerts(tmp_path, wandb_env):
    from nummon.integrations.tensorboard import TensorBoardSink
    from nummon.integrations.wandb import WandbSink

    tb_dir = tmp_path / "tb"
    tb = TensorBoardSink(tb_dir)
    wb = WandbSink(project="nummon-test")
    assert wb.offline
    mon, reports = runaway_run([tb, wb, JsonlSink(tmp_path / "events.jsonl")], tmp_path, policy=POLICY)
    nf = first_nonfinite(reports)
    steps = [r.step for r in reports]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in (
        "nummon/loss",
        "nummon/grad_norm",
        "nummon/grad_max",
        "nummon/param_norm",
        "nummon/optim_state_norm",
        "nummon/update_ratio",
        "nummon/activation_max",
        "nummon/headroom",
        "nummon_layers_grad_norm/0.weight",
    ):
        assert tag in tags["scalars"], tag
    assert [e.step for e in acc.Scalars("nummon/loss")] == steps
    assert acc.Scalars("nummon/loss")[0].value == pytest.approx(reports[0].record.loss, rel=1e-6)
    hist_steps = [e.step for e in acc.Histograms("nummon_hist_grads_log10abs/0.weight")]
    # the cadence, and every incident event's step (the moment of trouble); the log10|x| view at each
    incident_steps = {e.step for r in reports for e in r.incidents}
    assert hist_steps == [s for s in steps if s % HIST_EVERY == 0 or s in incident_steps]
    # the linear view only where its values stay within 1e6 (past that its axis is unreadable)
    linear = [e.step for e in acc.Histograms("nummon_hist_grads/0.weight")]
    assert linear and set(linear) < set(hist_steps)
    assert "nummon_hist_activations/1" in tags["histograms"]
    texts = [
        e.tensor_proto.string_val[0].decode()
        for t in tags["tensors"]
        if t.startswith("nummon_2_alerts/")
        for e in acc.Tensors(t)
    ]
    assert any("CRITICAL runaway" in t and "flight recorder" in t for t in texts)

    records = read_records(find_run_file(wandb_env / "wandb_dir"))
    rows = history_rows(records)
    by_step = {row["_step"]: row for row in rows}
    assert sorted(by_step) == steps
    assert by_step[0]["nummon/loss"] == pytest.approx(reports[0].record.loss, rel=1e-6)
    row = by_step[HIST_EVERY]
    assert row["nummon_hist_grads/0.weight/_type"] == "histogram"
    assert sum(row["nummon_hist_grads/0.weight/values"]) == 16 * 8  # every element of the weight's gradient
    assert not any(k.startswith("nummon_hist_") for k in by_step[HIST_EVERY + 1])
    # one W&B alert per incident event: opened (warning), critical, non-finite
    al = wb_alerts(records)
    assert [a.level for a in al] == ["WARN", "ERROR", "ERROR"], [(a.title, a.level) for a in al]
    assert all(len(a.title) < 64 for a in al)
    crit = al[1]
    assert "runaway" in crit.title
    # sent before the first non-finite step: its text names an earlier step and the flight record
    crit_alert = next(a for a in mon.alerts if a.kind is AlertKind.RUNAWAY and a.severity is Severity.CRITICAL)
    assert crit_alert.step < nf
    assert f"at step {crit_alert.step}" in crit.text and "flight record" in crit.text


def test_wandb_client_side_throttle(wandb_env):
    from nummon.integrations.wandb import WandbSink

    wb = WandbSink(project="nummon-test", wait_duration=3600, per_alert=True)

    def mk(step, sev):
        return Alert(step=step, kind=AlertKind.EXPLOSION, severity=sev, message="m", metric="grad_norm")

    wb.on_alert(mk(1, Severity.WARNING))
    wb.on_alert(mk(2, Severity.WARNING))  # throttled
    wb.on_alert(mk(3, Severity.CRITICAL))  # escalation goes through
    wb.on_alert(mk(4, Severity.INFO))  # below alert_min_severity
    wb.close()
    assert [lvl for _, lvl, _ in wb.sent_alerts] == ["WARN", "ERROR"]
    levels = [a.level for a in wb_alerts(read_records(find_run_file(wandb_env / "wandb_dir")))]
    assert levels == ["WARN", "ERROR"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_tensorboard_server_serves_scalars_and_histograms(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    tb_dir = tmp_path / "tb"
    runaway_run([TensorBoardSink(tb_dir)], tmp_path, steps=25, policy=POLICY)
    port = _free_port()
    exe = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen(
        [str(exe), "--logdir", str(tb_dir), "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}/data/plugin"
        scalars = hists = not_ready = None
        for _ in range(120):  # the server needs a moment to start and load the run
            assert proc.poll() is None, f"tensorboard exited with {proc.returncode}"
            try:
                scalars = json.load(urllib.request.urlopen(f"{base}/scalars/scalars?run=.&tag=nummon/loss", timeout=2))
                hists = json.load(
                    urllib.request.urlopen(
                        f"{base}/histograms/histograms?run=.&tag=nummon_hist_grads/0.weight", timeout=2
                    )
                )
                if len(scalars) == 25 and len(hists) == 3:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:  # not serving, or not loaded, yet
                not_ready = e
            time.sleep(0.5)
        assert scalars is not None and hists is not None, f"tensorboard never served both: {not_ready!r}"
        assert [row[1] for row in scalars] == list(range(25))
        assert [row[1] for row in hists] == [0, 10, 20]
    finally:
        os.kill(proc.pid, 15)
        proc.wait(timeout=30)


class RaisingSink(nummon.BaseSink):
    def __init__(self):
        self.calls = 0

    def on_step(self, record, health):
        self.calls += 1
        raise RuntimeError("backend down")

    def on_alert(self, alert):
        raise RuntimeError("backend down")


class BlockingSink(nummon.BaseSink):
    def __init__(self):
        self.release = threading.Event()
        self.seen = 0

    def on_step(self, record, health):
        self.release.wait(30)
        self.seen += 1


def test_failing_and_blocking_sinks_never_stop_training_and_no_alert_is_lost(tmp_path, caplog):
    raising, blocking = RaisingSink(), BlockingSink()
    log = tmp_path / "events.jsonl"
    pol = {"sinks": {"queue_size": 4}, "alerts": {"stop_on_critical": False}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 8) * 2, torch.randn(64, 1)
    mon = Monitor(model, opt, policy=pol, sinks=[raising, blocking, JsonlSink(log)])
    for _ in range(60):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        mon.post_step(loss)
    # every step returned while the blocking sink was still stuck on its first record
    assert blocking.seen == 0 and mon.step == 60
    stats = mon.sink_stats
    assert stats["BlockingSink"]["dropped"] > 0  # its bounded queue overflowed: statistics dropped
    blocking.release.set()
    mon.close()
    assert raising.calls > 0 and mon.sink_stats["RaisingSink"]["errors"] >= raising.calls
    assert sum("sink RaisingSink failed" in r.message for r in caplog.records) == 1  # reported once
    logged = [json.loads(l) for l in log.read_text().splitlines()]
    logged_alerts = [(a["step"], a["kind"], a["severity"]) for a in logged if a["type"] == "alert"]
    assert logged_alerts == [(a.step, a.kind.value, a.severity.value) for a in mon.alerts]
    assert any(s == "critical" for _, _, s in logged_alerts)
    # step records may be dropped under a full queue (counted); alerts never are
    assert len([a for a in logged if a["type"] == "step"]) + mon.sink_stats["JsonlSink"]["dropped"] == 60


def test_install_hints_without_extras(tmp_path):
    code = (
        "import sys; sys.modules['wandb'] = None; sys.modules['tensorboard'] = None\n"
        "import nummon\n"
        "from nummon.integrations.wandb import WandbSink\n"
        "from nummon.integrations.tensorboard import TensorBoardSink\n"
        "for cls, arg in ((WandbSink, None), (TensorBoardSink, 'x')):\n"
        "    try:\n"
        "        cls() if arg is None else cls(arg)\n"
        "    except ImportError as e:\n"
        "        print('HINT', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path).stdout
    assert "pip install 'nummon[wandb]'" in out and "pip install 'nummon[tensorboard]'" in out


# ------------------------------------------------------------------ contract suite over every sink


def test_tensorboard_sink_histogram_every_alone_drives_histograms(tmp_path):
    """TensorBoardSink(histogram_every=N) needs no policy setting to get histograms."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nummon.integrations.tensorboard import TensorBoardSink

    tb_dir = tmp_path / "tb"
    runaway_run(
        [TensorBoardSink(tb_dir, histogram_every=7)], tmp_path, steps=20, policy={"alerts": {"stop_on_critical": False}}
    )
    acc = EventAccumulator(str(tb_dir), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Histograms("nummon_hist_grads/0.weight")] == [0, 7, 14]


class SlowSink(nummon.BaseSink):
    def __init__(self):
        self.records = []

    def on_step(self, record, health):
        time.sleep(0.01)
        self.records.append(record.step)


class GatedStepSink(nummon.BaseSink):
    """A sink that cannot take a step record until the test lets it: slower than any producer."""

    def __init__(self):
        self.records = []
        self.release = threading.Event()

    def on_step(self, record, health):
        self.release.wait(60)
        self.records.append(record.step)


def test_when_full_block_keeps_every_record():
    slow = SlowSink()
    mon = Monitor(policy={"sinks": {"queue_size": 2, "when_full": "block", "block_timeout_s": 60}}, sinks=[slow])
    for _ in range(30):
        mon.post_step(1.0)
    mon.close()
    assert slow.records == list(range(30)) and mon.sink_stats["SlowSink"]["dropped"] == 0


def test_when_full_drop_counts_what_it_drops():
    gated = GatedStepSink()
    mon = Monitor(policy={"sinks": {"queue_size": 2, "when_full": "drop"}}, sinks=[gated])
    for _ in range(30):
        mon.post_step(1.0)
    gated.release.set()  # the sink held at most one record and a full queue of two
    mon.close()
    dropped = mon.sink_stats["GatedStepSink"]["dropped"]
    assert dropped >= 27 and len(gated.records) + dropped == 30
    assert gated.records == sorted(gated.records) and gated.records[0] == 0


def test_a_non_sink_is_rejected():
    with pytest.raises(nummon.NummonError, match="is not a sink"):
        Monitor(sinks=[object()])
