"""The views a new user gets from TensorBoardSink / WandbSink with default arguments: histograms
on by default, at most 12 run-level charts whatever the model, per-layer groups, log10
companions, a custom-scalars layout, every alert and incident event as text, W&B sections and
summary fields. Read back from real event files, a real TensorBoard server and a real W&B run file."""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch
from helpers.models import runaway_run
from helpers.wandb_reader import alerts as wb_alerts
from helpers.wandb_reader import find_run_file, history_rows, read_records
from torch import nn

from nummon import Health, IncidentEvent, IncidentState, Monitor, StepRecord
from nummon._sinks.layout import DEFAULT_HISTOGRAM_EVERY, MAIN_CHARTS, TopOffenders, histogram_tags, step_scalars
from nummon._tools.demo_model import DemoCNN

NO_STOP = {"alerts": {"stop_on_critical": False}}


CRITICAL_INCIDENT = IncidentEvent(
    step=2, state=IncidentState.CRITICAL, previous=IncidentState.OPEN, number=1, opened_step=1
)


class TwoBlockTransformer(nn.Module):
    """A tiny causal-free two-block transformer classifier over token sequences."""

    def __init__(self, vocab=32, d=16, heads=2, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)).mean(1))


def cnn_batch():
    return torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))


def transformer_batch():
    return torch.randint(0, 32, (8, 6)), torch.randint(0, 4, (8,))


def train(model, batch, sinks, tmp_path, steps=3, lr=0.01, policy="default"):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = batch
    mon = Monitor(model, opt, policy=policy, sinks=sinks, run_dir=tmp_path)
    reports = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        reports.append(mon.post_step(loss))
    mon.close()
    return mon, reports


def runaway(sinks, tmp_path, steps=80):
    """The sink tests' runaway (a two-layer regression on SGD+momentum, ~step 40), run to the end."""
    return runaway_run(sinks, tmp_path, steps, policy=NO_STOP)


def event_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def groups(tags):
    out = {}
    for tag in tags:
        out.setdefault(tag.split("/", 1)[0], []).append(tag)
    return out


# ---------------------------------------------------------------- histograms on by default


@pytest.mark.slow
def test_default_tensorboard_sink_writes_histograms(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    tb = TensorBoardSink(tmp_path / "tb")  # default arguments, default policy (histogram_every 0)
    mon, _ = train(DemoCNN(), cnn_batch(), [tb], tmp_path, steps=3)
    assert mon._hist.every == [DEFAULT_HISTOGRAM_EVERY]
    hist_tags = event_tags(tmp_path / "tb").Tags()["histograms"]
    for name in ("params/fc1.weight", "grads/conv1.weight", "activations/fc2"):
        linear, log10 = histogram_tags(name)
        assert linear in hist_tags and log10 in hist_tags, (name, hist_tags)
    # the default cadence: log-spaced early steps (0, 1, 2, 5, 10, ...), then every 500
    assert [e.step for e in event_tags(tmp_path / "tb").Histograms("nummon_hist_grads/fc1.weight")] == [0, 1, 2]


def test_histograms_off_for_a_sink_that_says_so(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    mon, _ = train(DemoCNN(), cnn_batch(), [TensorBoardSink(tmp_path / "tb", histogram_every=0)], tmp_path, steps=2)
    assert mon._hist.every == []
    assert event_tags(tmp_path / "tb").Tags()["histograms"] == []


# ---------------------------------------------------------------- layout


def test_demo_cnn_and_two_block_transformer_have_the_same_main_group(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    main = {}
    for name, model, batch in (
        ("cnn", DemoCNN(), cnn_batch()),
        ("transformer", TwoBlockTransformer(), transformer_batch()),
    ):
        train(model, batch, [TensorBoardSink(tmp_path / name)], tmp_path / name, steps=3)
        by_group = groups(event_tags(tmp_path / name).Tags()["scalars"])
        main[name] = sorted(by_group["nummon"])
        assert len(main[name]) <= 12
        assert set(main[name]) <= {f"nummon/{c}" for c in MAIN_CHARTS}
        # per-layer series live in groups of their own, one line per layer
        assert len(by_group["nummon_layers_grad_norm"]) == sum(1 for p in model.parameters() if p.requires_grad)
        assert by_group["nummon_layers_activation_max"]
        assert sorted(by_group["nummon_log10"]) == [
            "nummon_log10/activation_max",
            "nummon_log10/grad_norm",
            "nummon_log10/loss",
        ]
    assert main["cnn"] == main["transformer"]
    assert len(groups(event_tags(tmp_path / "transformer").Tags()["scalars"])["nummon_layers_grad_norm"]) > 20


def test_log10_companions_and_health_series():
    rec = StepRecord(step=3, loss=250.0, grad_norm=1e6, activation_max=0.0, headroom=30.5)
    tags = step_scalars(rec, Health.EXTREME, IncidentState.CRITICAL)
    assert tags["nummon_log10/loss"] == pytest.approx(math.log10(250.0))
    assert tags["nummon_log10/grad_norm"] == pytest.approx(6.0)
    assert "nummon_log10/activation_max" not in tags  # log10(0) has no point
    assert tags["nummon/incident_state"] == 2.0
    assert tags["nummon/health"] == float(Health.EXTREME.code)
    assert {t: v for t, v in tags.items() if t.startswith("nummon_health/")} == {
        f"nummon_health/{h.value}": float(h is Health.EXTREME) for h in Health
    }
    nan = step_scalars(StepRecord(step=4, loss=float("nan"), grad_norm=float("inf")), Health.NONFINITE)
    assert math.isnan(nan["nummon_log10/loss"]) and nan["nummon_log10/grad_norm"] == math.inf


def test_top_offenders_keep_the_k_largest_layers_so_far():
    top = TopOffenders(k=2)
    first = top.update(StepRecord(step=0, layer_grad_norms={"a": 1.0, "b": 5.0, "c": 3.0}))
    assert sorted(first) == ["nummon_top_grad_norm/b", "nummon_top_grad_norm/c"]
    # "b" fell back but its peak (5) still leads; "a" went non-finite: it leads everything
    second = top.update(StepRecord(step=1, layer_grad_norms={"a": float("nan"), "b": 0.1, "c": 2.0}))
    assert sorted(second) == ["nummon_top_grad_norm/a", "nummon_top_grad_norm/b"]
    assert second["nummon_top_grad_norm/b"] == 0.1


# ---------------------------------------------------------------- text entries


def test_every_alert_of_a_step_is_its_own_text_entry(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    tb_dir = tmp_path / "tb"
    mon, _ = runaway([TensorBoardSink(tb_dir)], tmp_path)
    steps = [a.step for a in mon.alerts]
    assert len(steps) > len(set(steps)), "the run should raise several alerts at one step"
    acc = event_tags(tb_dir)
    alert_tags = [t for t in acc.Tags()["tensors"] if t.startswith("nummon_2_alerts/")]
    raised = [a for a in mon.alerts if not a.cleared]
    assert len(alert_tags) == len(raised)  # a cleared alert gets no entry: the incident's events tell it
    texts = {t: acc.Tensors(t)[-1].tensor_proto.string_val[0].decode() for t in alert_tags}
    for alert in raised:
        assert any(f"{alert.kind.value} at step {alert.step}: {alert.message}" in text for text in texts.values())


# ---------------------------------------------------------------- a real TensorBoard server


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base, path, **query):
    url = f"{base}/data/plugin/{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    return json.load(urllib.request.urlopen(url, timeout=3))


@pytest.mark.slow
def test_real_tensorboard_server_shows_the_views(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    tb_dir = tmp_path / "tb"
    mon, reports = runaway([TensorBoardSink(tb_dir)], tmp_path, steps=70)
    events = mon.incidents  # delivered to the sink by the Monitor
    assert [e.state.value for e in events] == ["open", "critical", "nonfinite"]

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tb_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    want_texts = len([a for a in mon.alerts if not a.cleared]) + len(events)
    try:
        scalars = layout = hists = texts = not_ready = None
        for _ in range(240):  # the server needs a moment to start and load the run
            assert proc.poll() is None, f"tensorboard exited with {proc.returncode}"
            try:
                scalars = _get(base, "scalars/tags")["."]
                layout = _get(base, "custom_scalars/layout")
                hists = _get(base, "histograms/tags")["."]
                texts = _get(base, "text/tags")["."]
                loss = _get(base, "scalars/scalars", run=".", tag="nummon/loss")
                if len(loss) == len(reports) and len(texts) >= want_texts + 1 and layout:
                    break
            # not serving yet, or the run (".") not loaded yet; anything else is a failure of its own
            except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError) as e:
                not_ready = e
            time.sleep(0.5)
        assert None not in (scalars, layout, hists, texts), f"tensorboard never served every view: {not_ready!r}"
        by_group = groups(scalars)
        assert 8 <= len(by_group["nummon"]) <= 12, by_group["nummon"]
        assert {"nummon/loss", "nummon/grad_norm", "nummon/health", "nummon/incident_state", "nummon/headroom"} <= set(
            by_group["nummon"]
        )
        assert {
            "nummon_log10",
            "nummon_health",
            "nummon_layers_grad_norm",
            "nummon_layers_activation_max",
            "nummon_top_grad_norm",
            "nummon_top_activation_max",
        } <= set(by_group)
        # the custom-scalars layout: one multiline chart per per-layer metric and the top offenders
        charts = {c["title"]: c["multiline"]["tag"] for cat in layout["category"] for c in cat["chart"]}
        regexes = [r for tags in charts.values() for r in tags]
        assert "^nummon_layers_grad_norm/" in regexes and "^nummon_layers_activation_max/" in regexes
        assert any(t.startswith("grad norm: the 5 largest") for t in charts)
        assert "nummon_hist_grads/0.weight" in hists and "nummon_hist_grads_log10abs/0.weight" in hists
        assert "nummon_hist_activations_log10abs/1" in hists
        assert len([t for t in texts if t.startswith("nummon_2_alerts/")]) == len(
            [a for a in mon.alerts if not a.cleared]
        )
        # incidents first: the Text tab lists the groups alphabetically
        groups_listed = [t.split("/")[0] for t in sorted(texts)]
        assert groups_listed.index("nummon_1_incidents") < groups_listed.index("nummon_2_alerts")
        incident_tags = sorted(t for t in texts if t.startswith("nummon_1_incidents/"))
        assert [t.split("/")[1].split("_", 1)[-1] + "/" + t.split("/")[2] for t in incident_tags] == [
            "open/text_summary",
            "critical/text_summary",
            "nonfinite/text_summary",
        ], incident_tags
        body = _get(base, "text/text", run=".", tag=incident_tags[1])
        assert [row["step"] for row in body] == [events[1].step] and "critical" in body[0]["text"]
        assert "nummon/legend/text_summary" in texts
    finally:
        os.kill(proc.pid, 15)
        proc.wait(timeout=30)


# ---------------------------------------------------------------- W&B


@pytest.mark.slow
def test_wandb_offline_run_holds_sections_histograms_and_summary(tmp_path, wandb_env):
    from nummon.integrations.wandb import STEP_METRIC, WandbSink

    wb = WandbSink(project="nummon-views")  # default arguments: histograms at the default cadence
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    mon = Monitor(model, opt, sinks=[wb], run_dir=tmp_path)
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        mon.post_step(loss)
    mon.flush()
    wb.on_incident(CRITICAL_INCIDENT)
    mon.close()

    records = read_records(find_run_file(wandb_env / "wandb_dir"))
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    globs = {m.glob_name: m.step_metric for m in metrics if m.glob_name}
    for section in (
        "nummon/*",
        "nummon_log10/*",
        "nummon_health/*",
        "nummon_layers_grad_norm/*",
        "nummon_layers_activation_max/*",
        "nummon_top_grad_norm/*",
        "nummon_hist_*",
    ):
        assert globs.get(section) == STEP_METRIC, (section, globs)
    rows = {row["_step"]: row for row in history_rows(records)}
    assert sorted(rows) == [0, 1, 2]
    main = {k for k in rows[1] if k.startswith("nummon/")}
    assert len(main) <= 12 and "nummon/loss" in main
    assert rows[0]["nummon_hist_grads/0.weight/_type"] == "histogram"
    assert sum(rows[0]["nummon_hist_grads_log10abs/0.weight/values"]) == 16 * 8
    assert (
        rows[1]["nummon_hist_grads/0.weight/_type"] == "histogram"
    )  # the default cadence: 0, 1, 2, 5, ... then every 500
    assert rows[2]["nummon_layers_grad_norm/2.weight"] > 0
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    assert summary["nummon/incident"] == "critical" and summary["nummon/incident_step"] == 2
    assert summary["nummon/incident_title"] == CRITICAL_INCIDENT.title == "nummon: run critical"
    assert [(a.title, a.level) for a in wb_alerts(records)] == [("nummon: run critical", "ERROR")]
