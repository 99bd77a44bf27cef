"""One contract over every built-in sink (composer's callback-test style): each implements the
whole `Sink` protocol, takes every method in the Monitor's order (bind, steps with non-finite
values, histograms, alerts of every kind and severity, an incident event, flush, close), closes
twice without harm, and delivers the incident event where its user looks for it."""

import json
import logging

import numpy as np
import pytest
from helpers.wandb_reader import alerts as wandb_alerts
from helpers.wandb_reader import find_run_file, read_records

import nummon
from nummon import Alert, AlertKind, Contributor, Health, IncidentEvent, IncidentState, RunContext, Severity, StepRecord
from nummon._sinks.layout import INCIDENTS_GROUP

INCIDENT = IncidentEvent(
    step=7,
    state=IncidentState.CRITICAL,
    previous=IncidentState.OPEN,
    number=1,
    opened_step=5,
    contributors=(
        Contributor(step=7, kind=AlertKind.RUNAWAY, severity=Severity.CRITICAL, metric="loss", value=float("inf")),
    ),
)
HIST = {
    "grads/fc.weight": {
        "min": -1.0,
        "max": 1.0,
        "sum": 0.0,
        "sum_squares": 2.0,
        "num": 4.0,
        "counts": np.array([2.0, 2.0]),
        "edges": np.array([-1.0, 0.0, 1.0]),
        "log10_counts": np.array([0.0, 4.0]),
        "log10_edges": np.array([-30.0, 0.0, 39.0]),
    }
}


def jsonl_delivered(sink, tmp_path, caplog, wandb_env):
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (incident,) = [e for e in lines if e["type"] == "incident"]
    assert incident["state"] == "critical" and incident["title"] == INCIDENT.title
    assert sum(e["type"] == "alert" for e in lines) == len(AlertKind) * len(Severity)


def memory_delivered(sink, tmp_path, caplog, wandb_env):
    assert sink.incidents == [INCIDENT] and sink.closed and len(sink.records) == 2


def console_delivered(sink, tmp_path, caplog, wandb_env):
    assert [r.levelno for r in caplog.records if INCIDENT.title in r.getMessage()] == [logging.ERROR]


def tensorboard_delivered(sink, tmp_path, caplog, wandb_env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    incidents = [t for t in acc.Tags()["tensors"] if t.startswith(INCIDENTS_GROUP + "/")]
    assert len(incidents) == 1 and incidents[0].endswith("_critical/text_summary"), incidents


def wandb_delivered(sink, tmp_path, caplog, wandb_env):
    import wandb

    wandb.teardown()
    sent = wandb_alerts(read_records(find_run_file(wandb_env / "wandb_dir")))
    assert [a.title for a in sent if a.title == INCIDENT.title] == [INCIDENT.title]


def scrape(url):
    """{(metric sample name, labels other than run and source): value} of one GET of a /metrics endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "source")))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.labels.get("run") == "contract"
    }


def prometheus_delivered(sink, tmp_path, caplog, wandb_env):
    import urllib.error
    import urllib.request

    got = sink.scraped_before_close
    assert got[("nummon_incident_state", ())] == INCIDENT.state.rank
    assert got[("nummon_loss", ())] == 0.5 and got[("nummon_last_step", ())] == 100
    alerts = {k: v for k, v in got.items() if k[0] == "nummon_alerts_total"}
    assert len(alerts) == len(AlertKind) * len(Severity) and set(alerts.values()) == {1.0}
    assert sink.url is None  # the endpoint is down after close
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(sink.scraped_url, timeout=5)


def mlflow_delivered(sink, tmp_path, caplog, wandb_env):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(sink.client.tracking_uri)
    run = client.get_run(sink.run_id)
    assert run.data.tags["nummon.state"] == "critical" and run.data.tags["nummon.incident"] == INCIDENT.title
    assert [m.step for m in client.get_metric_history(sink.run_id, "nummon/loss")] == [0, 100]
    assert [a.path for a in client.list_artifacts(sink.run_id, "nummon")] == ["nummon/incident-1-step7.md"]


def make(name, tmp_path):
    if name == "jsonl":
        return nummon.JsonlSink(tmp_path / "events.jsonl")
    if name == "memory":
        return nummon.MemorySink()
    if name == "console":
        return nummon.ConsoleSink()
    if name == "tensorboard":
        from nummon.integrations.tensorboard import TensorBoardSink

        return TensorBoardSink(tmp_path / "tb")
    if name == "wandb":
        from nummon.integrations.wandb import WandbSink

        return WandbSink(project="nummon-contract")
    if name == "mlflow":
        pytest.importorskip("mlflow")
        from nummon.integrations.mlflow import MlflowSink

        return MlflowSink(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="contract")
    pytest.importorskip("prometheus_client")
    from nummon.integrations.prometheus import PrometheusSink

    return PrometheusSink(listen="127.0.0.1:0", run="contract")


DELIVERED = {
    "jsonl": jsonl_delivered,
    "memory": memory_delivered,
    "console": console_delivered,
    "tensorboard": tensorboard_delivered,
    "wandb": wandb_delivered,
    "prometheus": prometheus_delivered,
    "mlflow": mlflow_delivered,
}


SLOW_SINKS = {"mlflow", "tensorboard", "wandb"}  # each starts a backend of its own (seconds)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SINKS else n for n in sorted(DELIVERED)]
)
def test_every_sink_keeps_the_contract(name, tmp_path, caplog, wandb_env):
    caplog.set_level(logging.INFO, logger="nummon")
    sink = make(name, tmp_path)
    assert isinstance(sink, nummon.Sink)  # the whole protocol: every method and attribute
    assert sink.durable is (name == "jsonl")  # only the event log is waited for on a critical alert
    sink.bind(RunContext(rank=0, world_size=1, run_dir=tmp_path, flush_every_steps=1))
    rec = StepRecord(
        step=0, loss=1.0, grad_norm=float("nan"), grad_max=float("inf"), layer_grad_norms={"fc.weight": 1.0}
    )
    sink.on_step(rec.freeze(), Health.NONFINITE)
    if sink.wants_histograms:
        sink.on_histograms(0, HIST)
    for i, kind in enumerate(AlertKind):
        for sev in Severity:
            sink.on_alert(
                Alert(
                    step=i + 1,
                    kind=kind,
                    severity=sev,
                    message="m",
                    metric="loss",
                    value=float("nan"),
                    details={"recent": [rec.to_dict()]},
                )
            )
    sink.on_incident(INCIDENT)
    sink.on_step(StepRecord(step=100, loss=0.5).freeze(), Health.HEALTHY)
    sink.flush()
    if name == "prometheus":  # its user looks at the live endpoint, which close takes down
        sink.scraped_url = sink.url
        sink.scraped_before_close = scrape(sink.url)
    sink.close()
    sink.close()  # idempotent: the Monitor's close and an exit handler may both close it
    DELIVERED[name](sink, tmp_path, caplog, wandb_env)


def test_a_partial_user_sink_is_completed_and_a_non_sink_refused():
    class OnlyAlerts:
        def __init__(self):
            self.alerts = []

        def on_alert(self, alert):
            self.alerts.append(alert)

    user = OnlyAlerts()
    mon = nummon.Monitor(sinks=[user], policy={"alerts": {"stop_on_critical": False}})
    for loss in [2.0] * 12 + [float("nan")]:
        mon.post_step(loss)
    mon.close()
    assert user.alerts and mon.sink_stats["OnlyAlerts"]["errors"] == 0
    with pytest.raises(nummon.NummonError, match="is not a sink"):
        nummon.Monitor(sinks=[object()])
