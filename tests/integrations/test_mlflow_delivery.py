"""MlflowSink against tracking servers that do not answer: real HTTP servers on 127.0.0.1 that
answer MLflow's REST calls and then stop answering, or a port where nothing listens. Creating
the sink and the Monitor asks the server nothing; every step record whose metrics the server
did not take is counted in `sink_stats`."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("mlflow")

from helpers.http_answers import AnswerServer, as_json  # noqa: E402
from helpers.mlflow_server import free_port  # noqa: E402

from nummon import MlflowSink, Monitor  # noqa: E402

RUN = {
    "run_id": "r1",
    "run_uuid": "r1",
    "experiment_id": "1",
    "status": "RUNNING",
    "lifecycle_stage": "active",
    "artifact_uri": "mlflow-artifacts:/1/r1/artifacts",
}


class StallingTracker:
    """Answers MLflow's REST calls as a server would (experiment lookup and creation, run
    creation, batches) until `answered_batches` metric batches have been taken; every request
    after that is held until `release` is set (then refused with 503). `steps` holds the steps of
    every metric the server took."""

    def __init__(self, answered_batches: int) -> None:
        self.received = threading.Event()
        self.release = threading.Event()
        self.steps: set[int] = set()
        self.batches = 0
        self.server = AnswerServer(self._answer)
        self.uri = self.server.uri
        self.left = answered_batches

    def _answer(self, req):
        self.received.set()
        body = json.loads(req.body or b"{}")
        if req.path.endswith("/runs/log-batch") and body.get("metrics"):
            if self.left <= 0:
                self.release.wait(30)
                return 503, {}, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}'
            self.left -= 1
            self.steps |= {int(m["step"]) for m in body["metrics"]}
            return as_json({})
        if req.path.endswith("/experiments/get-by-name"):
            return 404, {"Content-Type": "application/json"}, b'{"error_code": "RESOURCE_DOES_NOT_EXIST"}'
        if req.path.endswith("/experiments/create"):
            return as_json({"experiment_id": "1"})
        if req.path.endswith("/runs/create"):
            return as_json({"run": {"info": RUN, "data": {}}})
        return as_json({})  # tags, termination

    def close(self) -> None:
        self.release.set()
        self.server.close()


@pytest.fixture(autouse=True)
def _no_retries(monkeypatch):
    """MLflow's client retries a failed request for minutes by default; one try each here."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")


@pytest.mark.parametrize("answered", [0, 3])
def test_a_server_that_stops_answering_delays_neither_the_monitor_nor_training_and_loses_counted_steps(
    tmp_path, answered
):
    tracker = StallingTracker(answered_batches=answered)
    mon = None
    try:
        sink = MlflowSink(tracking_uri=tracker.uri, experiment="stalled", batch_steps=10)
        mon = Monitor(sinks=[sink], run_dir=tmp_path, policy={"sinks": {"close_timeout_s": 1.0}})
        # the constructors returned before the server was asked anything
        assert not tracker.received.is_set() and sink.run_id is None
        for i in range(100):
            mon.post_step(2.0 - 0.01 * i)
        mon.close()
        delivered = len(tracker.steps)
        assert delivered == 10 * answered
        assert mon.sink_stats["MlflowSink"]["dropped"] == 100 - delivered  # every step it did not take
    finally:
        tracker.release.set()  # the sink's thread, refused from here on, ends before the test does
        for w in mon._sinks.workers if mon is not None else []:
            w.thread.join(60)
        tracker.close()


def test_a_refused_port_loses_every_step_and_counts_each(tmp_path):
    sink = MlflowSink(tracking_uri=f"http://127.0.0.1:{free_port()}", experiment="refused", batch_steps=10)
    mon = Monitor(sinks=[sink], run_dir=tmp_path, policy={"sinks": {"close_timeout_s": 60.0}})
    for i in range(35):
        mon.post_step(2.0 - 0.01 * i)
    mon.close()
    stats = mon.sink_stats["MlflowSink"]
    assert stats["dropped"] == 35 and stats["errors"] >= 1
