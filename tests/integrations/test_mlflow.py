"""MLflow as a home for nummon, against a real `mlflow server` (SQLite backend, local
artifacts) on 127.0.0.1: the sink's metrics, tags and artifacts read back through MlflowClient;
a run logged with plain mlflow (no nummon) replayed; a server gone mid-run leaves training unharmed."""

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("mlflow")

import mlflow  # noqa: E402
from helpers.mlflow_server import Relay, shared_server  # noqa: E402
from helpers.models import runaway_run  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from nummon import Health, MlflowSink, Monitor  # noqa: E402

pytestmark = pytest.mark.slow  # every test uses one real MLflow tracking server (started once, seconds)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The session's one real MLflow server (shared by the xdist workers; each test uses an
    experiment of its own)."""
    return shared_server(tmp_path_factory)


def test_a_runaway_shows_in_the_run_metrics_tags_and_artifacts(server, tmp_path):
    sink = MlflowSink(tracking_uri=server.uri, experiment="runaway", batch_steps=10)
    mon, reports = runaway_run([sink], tmp_path)
    assert reports[-1].health is Health.NONFINITE
    client = MlflowClient(server.uri)
    run = client.get_run(sink.run_id)
    tags = run.data.tags
    assert tags["nummon.state"] == "nonfinite" and tags["nummon.incident_state"] == "nonfinite"
    assert tags["nummon.incident"].startswith("nummon: run lost")
    assert tags["nummon.first_nonfinite"] and int(tags["nummon.first_nonfinite_step"]) == reports[-1].step
    assert run.info.status == "FAILED"  # a run the sink started, lost to non-finite values
    history = client.get_metric_history(sink.run_id, "nummon/loss")
    finite = [r.step for r in reports if math.isfinite(r.record.loss)]
    assert [m.step for m in history] == finite  # every finite step, none twice
    assert all(math.isfinite(m.value) and abs(m.value) < 1e308 for m in history)  # a chart a person can read
    assert history[0].value == pytest.approx(reports[0].record.loss)
    marker = client.get_metric_history(sink.run_id, "nummon/nonfinite/loss")
    assert [m.step for m in marker] == [r.step for r in reports if not math.isfinite(r.record.loss)] != []
    assert all(k.startswith("nummon/") for k in run.data.metrics)
    # batched: one log_batch per `batch_steps` steps (plus the flushes of critical incidents and close)
    assert sink.batches_sent <= len(reports) // 10 + 6 < len(reports)
    names = [a.path for a in client.list_artifacts(sink.run_id, "nummon")]
    incidents = [n for n in names if n.startswith("nummon/incident-")]
    assert incidents, names
    text = client.download_artifacts(sink.run_id, incidents[-1], str(tmp_path / "dl"))
    assert "Incident 1" in open(text).read() and "nonfinite" in open(text).read()
    assert [a.path for a in client.list_artifacts(sink.run_id, "nummon/flight-records")]
    assert "nummon/nummon-report.html" in names  # the incident report, as of its critical escalation


def test_a_run_that_overflows_is_replayed_from_mlflow_naming_the_first_non_finite_value_as_the_live_run_did(
    server, tmp_path
):
    """The parts the live run found non-finite (the loss first) are what `nummon replay mlflow:`
    names at the same step; every series nummon logged stays chartable (no NaN,
    no +-1.797e308) and the non-finite steps are in the `nummon/nonfinite/` markers."""
    import json

    from nummon import MemorySink

    sink, live = MlflowSink(tracking_uri=server.uri, experiment="overflow", batch_steps=10), MemorySink()
    mon, reports = runaway_run([sink, live], tmp_path)
    first_live = next(a for a in live.alerts if a.kind.value == "nonfinite")
    client = MlflowClient(server.uri)
    run = client.get_run(sink.run_id)
    markers = [k for k in run.data.metrics if k.startswith("nummon/nonfinite/")]
    assert markers and "nummon/nonfinite/loss" in markers
    for key in [k for k in run.data.metrics if not k.startswith("nummon/nonfinite/")]:
        values = [m.value for m in client.get_metric_history(sink.run_id, key)]
        assert all(math.isfinite(v) and abs(v) < 1.79e308 for v in values), key
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "--format", "jsonl", f"mlflow:{server.uri}#{sink.run_id}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    replayed = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    first = next(a for a in replayed if a["kind"] == "nonfinite")
    assert first["step"] == first_live.step == reports[-1].step
    assert first["details"]["parts"][0] == first_live.details["parts"][0] == "loss"
    assert first["location"] == "loss"  # the live run names a tensor (its forensics); the logs, the loss


def test_an_infinite_loss_logged_with_plain_mlflow_is_replayed_as_an_overflow(server):
    """MLflow stores +inf as 1.7976931348623157e308: read back, that is an overflow, not a finite
    value 1e306 times the loss's median."""
    import json

    mlflow.set_tracking_uri(server.uri)
    mlflow.set_experiment("plain-inf")
    with mlflow.start_run() as run:
        for step in range(30):
            mlflow.log_metrics({"train_loss": 2.0 * 0.98**step, "grad_norm": 1.0}, step=step)
        mlflow.log_metrics({"train_loss": float("inf"), "grad_norm": 1.0}, step=30)
    stored = MlflowClient(server.uri).get_metric_history(run.info.run_id, "train_loss")[-1].value
    assert stored > 1.79e308 and math.isfinite(stored)  # what the server made of +inf
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "--format", "jsonl", f"mlflow:{server.uri}#{run.info.run_id}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    replayed = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    first = next(a for a in replayed if a["kind"] == "nonfinite")
    assert (first["step"], first["location"]) == (30, "loss")
    assert not [a for a in replayed if a["step"] == 30 and a["kind"] != "nonfinite"], replayed


def test_inside_an_active_run_the_sink_logs_into_it(server, tmp_path):
    mlflow.set_tracking_uri(server.uri)
    mlflow.set_experiment("active")
    with mlflow.start_run() as active:
        sink = MlflowSink()
        mon = Monitor(sinks=[sink], run_dir=tmp_path)
        for loss in (2.0, 1.9, 1.8):
            mon.post_step(loss)
        mon.close()
        assert sink.run_id == active.info.run_id
    run = MlflowClient(server.uri).get_run(active.info.run_id)
    assert run.data.tags["nummon.state"] == "healthy" and run.data.metrics["nummon/loss"] == pytest.approx(1.8)
    assert run.info.status == "FINISHED"  # the user's run, ended by the user's `with`


def test_a_run_logged_with_plain_mlflow_is_replayed_with_its_warning_before_the_nan(server):
    mlflow.set_tracking_uri(server.uri)
    mlflow.set_experiment("plain")
    losses = [2.0 * 0.98**i for i in range(30)] + [0.9 * 3.0**k for k in range(1, 30)] + [float("nan")]
    with mlflow.start_run() as run:
        for step, loss in enumerate(losses):
            mlflow.log_metrics({"train_loss": loss, "learning_rate": 1e-3}, step=step)
    nan_step = len(losses) - 1
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "--format", "jsonl", f"mlflow:{server.uri}#{run.info.run_id}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    import json

    alerts = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    loud = [a for a in alerts if a["severity"] in ("warning", "critical")]
    assert loud and min(a["step"] for a in loud) <= nan_step - 3
    assert any(a["kind"] == "nonfinite" and a["step"] == nan_step for a in alerts)


def test_replay_of_a_missing_run_or_server_is_one_line_without_secrets(server):
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", f"mlflow:{server.uri}#no-such-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "no run 'no-such-run'" in p.stderr and "Traceback" not in p.stderr
    dead = server.uri.replace(str(server.port), "1")
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "mlflow:http://me:hunter2@127.0.0.1:1#r"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "not reachable" in p.stderr and "hunter2" not in p.stderr + p.stdout, (dead, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1


def test_a_server_gone_mid_run_leaves_training_unharmed(server, tmp_path):
    relay = Relay(server.port)
    sink = MlflowSink(tracking_uri=relay.uri, experiment="gone", batch_steps=5)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(
        model, opt, sinks=[sink], run_dir=tmp_path, policy={"sinks": {"close_timeout_s": 3.0, "flush_timeout_s": 60.0}}
    )
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    steps = 0
    for step in range(40):
        if step == 10:
            mon.flush()  # the first ten steps are in the run
            relay.cut()  # the tracking server is unreachable from here on
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        mon.post_step(loss)
        steps += 1
    mon.close()
    assert steps == 40
    assert sink.batches_sent == 2  # the two batches of the steps before the cut
    got = MlflowClient(server.uri).get_metric_history(sink.run_id, "nummon/loss")
    assert [m.step for m in got] == list(range(10))
    assert mon.sink_stats["MlflowSink"]["dropped"] == 30  # every step after the cut, each counted


def test_watch_follows_a_live_plain_mlflow_run_notifies_before_its_nan_and_outlives_the_server(server, tmp_path):
    """`nummon watch mlflow:<uri>?experiment=...` as a real subprocess posting to a real webhook: the
    runaway is notified while the run is still finite; then the server goes away (the relay is cut)
    and the watcher says so once and keeps running until it is stopped."""
    import json
    import signal
    import time

    from helpers.webhook_receiver import Receiver

    relay, receiver = Relay(server.port), Receiver()
    mlflow.set_tracking_uri(server.uri)
    mlflow.set_experiment("watched")
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nummon",
            "watch",
            f"mlflow:{relay.uri}?experiment=watched",
            "--interval",
            "0.5",
            "--notify",
            f"webhook:{receiver.url}",
            "--state",
            str(tmp_path / "state.json"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with mlflow.start_run() as run:
            losses = [2.0 * 0.98**i for i in range(30)] + [0.9 * 3.0**k for k in range(1, 30)]
            for step, loss in enumerate(losses):
                mlflow.log_metric("train_loss", loss, step=step)
            deadline = time.monotonic() + 180
            while not receiver.bodies and time.monotonic() < deadline and watcher.poll() is None:
                time.sleep(0.2)
            assert receiver.bodies, "no notification before the NaN"
            mlflow.log_metric("train_loss", float("nan"), step=len(losses))
        first = receiver.bodies[0]["text"]
        assert run.info.run_id in first and "Incident 1 opened" in first
        relay.cut()
        time.sleep(3)
        assert watcher.poll() is None  # alive without its server
    finally:
        watcher.send_signal(signal.SIGTERM)
        err = watcher.communicate(timeout=60)[1]
        receiver.close()
    assert watcher.returncode == 0, err
    assert "not reachable" in err and err.count("not reachable") == 1, err
    assert "Traceback" not in err
    assert json.dumps(receiver.bodies)  # strict JSON bodies
