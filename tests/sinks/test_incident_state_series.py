"""Every sink's `nummon/incident_state` series is the run's incident state at that series' own
step: the state after that step's report, as the incident events say (the latest event at or
before the step), whatever the sink's thread lags behind. Read back from a sink whose thread is
held until the run has ended, from TensorBoard's event files, a W&B offline run and a real MLflow
server."""

import math
import threading

import pytest
from helpers.incident_series import expected_series
from helpers.models import runaway_run
from helpers.wandb_reader import find_run_file, history_rows, read_records

from nummon import BaseSink, IncidentState, MemorySink

pytestmark = pytest.mark.slow  # three real sinks and a real run


class HeldSink(BaseSink):
    """Asynchronous, and its first step waits until the run has gone non-finite: every incident
    event then overtakes the queued step records on its thread (as a slow server makes an MLflow
    sink do)."""

    def __init__(self):
        self.release = threading.Event()
        self.series = {}

    def on_step(self, record, health):
        self.release.wait(60)
        self.series[record.step] = self.incident_state.rank


class Releaser(MemorySink):
    """On the training thread: lets the held sink go once the run's last event is queued."""

    synchronous = True

    def __init__(self, held):
        super().__init__()
        self.held = held

    def on_incident(self, event):
        super().on_incident(event)
        if event.state is IncidentState.NONFINITE:
            self.held.release.set()


def test_a_sink_whose_thread_lags_charts_each_steps_own_state(tmp_path):
    held = HeldSink()
    memory = Releaser(held)
    try:
        mon, reports = runaway_run([held, memory], tmp_path / "run", steps=80)
    finally:
        held.release.set()
    steps = [r.step for r in reports]
    assert {e.state for e in memory.incidents} >= {IncidentState.OPEN, IncidentState.NONFINITE}
    assert held.series == expected_series(memory.incidents, steps)


def test_tensorboard_wandb_and_mlflow_chart_each_steps_own_state(tmp_path, wandb_env, tmp_path_factory):
    from helpers.mlflow_server import shared_server
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nummon import MlflowSink, TensorBoardSink, WandbSink

    server = shared_server(tmp_path_factory)
    memory = MemorySink()
    mlflow_sink = MlflowSink(tracking_uri=server.uri, experiment="incident-state", batch_steps=7)
    sinks = [TensorBoardSink(tmp_path / "tb"), WandbSink(project="incident-state"), mlflow_sink, memory]
    mon, reports = runaway_run(sinks, tmp_path / "run", steps=80)
    steps = [r.step for r in reports]
    want = expected_series(memory.incidents, steps)
    assert len(set(want.values())) >= 3, want  # the run went through several states

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("nummon/incident_state")}
    assert tb == want

    rows = history_rows(read_records(find_run_file(tmp_path)))
    wb = {int(r["_step"]): r["nummon/incident_state"] for r in rows if "nummon/incident_state" in r}
    assert wb == want

    history = MlflowClient(server.uri).get_metric_history(mlflow_sink.run_id, "nummon/incident_state")
    ml = {m.step: m.value for m in history}
    assert ml == want
    assert all(not math.isnan(v) for v in ml.values())
