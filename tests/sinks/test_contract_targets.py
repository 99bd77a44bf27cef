"""One contract over every output: each watch `Target` and each Monitor sink (`BaseSink`) is
found by subclass, so a new one is covered (or this suite fails until it has a setting), and
runs the whole lifecycle against a real endpoint (an HTTP receiver on 127.0.0.1, files in a
temporary folder): what follows a run gets the run, an incident reaches its endpoint, close
twice does no harm, and a dead endpoint never raises into the watcher. Modelled on composer's
`tests/callbacks/callback_settings.py` (one settings table) with `test_callbacks.py`.

The Monitor-sink calls one by one, with each sink's own delivery, are in test_sink_contract.py;
here each sink runs under a real Monitor, the caller that wires it."""

from __future__ import annotations

import importlib
import inspect
import io
import json
import math
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from helpers.webhook_receiver import Receiver

import nummon
from nummon import BaseSink, load_policy
from nummon._core.json import dumps
from nummon._logs.discovery import RunSpec
from nummon._logs.readers import make_follower
from nummon._watch.notices import Notice
from nummon._watch.output import Outcome, Target
from nummon._watch.runs import WatchedRun
from nummon._watch.targets import ConsoleTarget, JsonlTarget, WandbTarget
from nummon._watch.watcher import Watcher

#: every module that may define a watch target or a Monitor sink (imported before the walk)
OUTPUT_MODULES = (
    "nummon._sinks.builtin",
    "nummon._watch.output",
    "nummon._watch.targets",
    "nummon._watch.webhook",
    "nummon._watch.alertmanager",
    "nummon.integrations.prometheus",
    "nummon.integrations.mlflow",
    "nummon.integrations.wandb",
    "nummon.integrations.tensorboard",
)


def subclasses(base: type) -> list[type]:
    """Every concrete, public subclass of `base` that nummon itself defines (a test's own
    subclass of a sink is not an output of the package), after importing `OUTPUT_MODULES`."""
    for name in OUTPUT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed: its outputs cannot be built here
            continue
    found: set[type] = set()
    todo = [base]
    c: type  # mypy infers no element type for type.__subclasses__()
    while todo:
        for c in todo.pop().__subclasses__():
            todo.append(c)
            if c.__module__.split(".")[0] == "nummon" and not c.__name__.startswith("_") and not inspect.isabstract(c):
                found.add(c)
    return sorted(found, key=lambda c: c.__qualname__)


# --- endpoints ---------------------------------------------------------------------------------


@dataclass
class Env:
    tmp_path: Path
    receiver: Receiver  # a live HTTP endpoint recording each JSON body
    dead_url: str  # an http URL nothing listens on (connection refused)


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- the settings: one entry per watch target ------------------------------------------------


@dataclass
class TargetSetting:
    make: Callable[[Env], Target]  # on a live endpoint
    delivered: Callable[[Target, Env, Notice], bool]  # the endpoint holds the notice
    make_down: Callable[[Env], Target] | None  # its endpoint down (None: it has no remote endpoint)
    marks: tuple = ()


def _console_delivered(t, env, notice):
    return notice.title in t.stream.getvalue()


def _closed_stream_console(env):
    stream = io.StringIO()
    stream.close()  # a closed stdout: every write raises
    return ConsoleTarget(stream)


def _jsonl_delivered(t, env, notice):
    lines = [json.loads(line) for line in open(t.path, encoding="utf-8")]
    return [d["event_id"] for d in lines] == [notice.event_id]


def _closed_jsonl(env):
    t = JsonlTarget(str(env.tmp_path / "down" / "notes.jsonl"))
    t.close()  # its file is gone from it: every write raises OSError
    return t


def _webhook_delivered(t, env, notice):
    return [b["event_id"] for b in env.receiver.bodies] == [notice.event_id]


def _alertmanager_delivered(t, env, notice):
    alerts = [a for b in env.receiver.bodies for a in b]
    return any(a["labels"]["run"] == notice.run and a["annotations"]["summary"] == notice.title for a in alerts)


def _wandb_target(env):
    from nummon.integrations.wandb import WandbSink

    return WandbTarget("nummon-contract", make_sink=WandbSink)


def _wandb_delivered(t, env, notice):
    return [title for title, _ in t.sent] == [notice.title]


def _webhook(url: str, **kw):
    from nummon._watch.webhook import WebhookTarget

    return WebhookTarget(url + "/hook", timeout_s=2.0, backoff_s=0.01, **kw)


def _alertmanager(url: str):
    from nummon._watch.alertmanager import AlertmanagerTarget

    return AlertmanagerTarget(url, timeout_s=2.0, retries=0, backoff_s=0.01, host="contract-host")


TARGET_SETTINGS: dict[str, TargetSetting] = {
    "ConsoleTarget": TargetSetting(
        lambda env: ConsoleTarget(io.StringIO()), _console_delivered, _closed_stream_console
    ),
    "JsonlTarget": TargetSetting(
        lambda env: JsonlTarget(str(env.tmp_path / "notes.jsonl")), _jsonl_delivered, _closed_jsonl
    ),
    "WebhookTarget": TargetSetting(
        lambda env: _webhook(env.receiver.url.removesuffix("/hook"), retries=0),
        _webhook_delivered,
        lambda env: _webhook(env.dead_url, retries=1),
    ),
    "AlertmanagerTarget": TargetSetting(
        lambda env: _alertmanager(env.receiver.url.removesuffix("/hook")),
        _alertmanager_delivered,
        lambda env: _alertmanager(env.dead_url),
    ),
    # offline W&B: the alert goes into the watcher's own run file; there is no endpoint to lose
    "WandbTarget": TargetSetting(_wandb_target, _wandb_delivered, None, (pytest.mark.slow,)),
}


def _target_params(down: bool = False):
    params = []
    for cls in subclasses(Target):
        s = TARGET_SETTINGS.get(cls.__name__)
        if s is None or (down and s.make_down is None):
            continue  # a class without a setting fails test_every_output_has_a_setting
        params.append(pytest.param(cls.__name__, marks=s.marks, id=cls.__name__))
    return params


# --- a watched run with an incident ----------------------------------------------------------


def _steady_then_nan(path, steps: int = 20) -> None:
    """A run that trains quietly for `steps` steps, then logs a NaN loss (a non-finite incident)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for s in range(steps):
            fh.write(dumps({"type": "step", "step": s, "loss": 2.0 - 0.01 * s, "grad_norm": 1.0}) + "\n")
        fh.write(dumps({"type": "step", "step": steps, "loss": math.nan, "grad_norm": math.inf}) + "\n")


@pytest.fixture
def env(tmp_path):
    r = Receiver()
    yield Env(tmp_path, r, _dead_url())
    r.close()


@pytest.fixture
def watched(tmp_path):
    """A real watched run that has read its records, its spec, and its first incident's notice."""
    log = tmp_path / "runs" / "a" / "events.jsonl"
    _steady_then_nan(log)
    run = WatchedRun(str(log), make_follower(str(log)), load_policy("default"))
    events = run.poll(final=True)
    assert events and run.records == 21
    yield run, RunSpec(str(log), "jsonl", [str(log)]), Notice.from_incident(events[0])
    run.close()


# --- the tests ---------------------------------------------------------------------------------


def test_every_output_has_a_setting():
    targets = {c.__name__ for c in subclasses(Target)}
    sinks = {c.__name__ for c in subclasses(BaseSink)}
    assert {"ConsoleTarget", "JsonlTarget", "WebhookTarget", "AlertmanagerTarget", "WandbTarget"} <= targets
    assert {"JsonlSink", "ConsoleSink", "MemorySink"} <= sinks
    assert targets - set(TARGET_SETTINGS) == set(), "a watch target without a TARGET_SETTINGS entry"
    assert sinks - set(SINK_SETTINGS) == set(), "a Monitor sink without a SINK_SETTINGS entry"


@pytest.mark.parametrize("name", _target_params())
def test_every_watch_target_keeps_the_contract(name, env, watched, wandb_env):
    setting = TARGET_SETTINGS[name]
    run, spec, notice = watched
    t = setting.make(env)
    assert isinstance(t, Target) and type(t).__name__ == name
    assert all(isinstance(v, str) and v for v in (t.key, t.shown, t.kind))
    outcomes: list[Outcome] = []
    t.report_outcomes_to(outcomes.append)
    t.run_started(run, spec)  # the run, with its records read
    t.on_incident(notice)
    if t.asynchronous:
        _wait_for("the outcome", lambda: len(outcomes) == 1)
        assert outcomes[0].ok and outcomes[0].event_id == notice.event_id
    else:
        assert outcomes == []  # a synchronous target has delivered when on_incident returns
    _wait_for(f"{name} to deliver", lambda: setting.delivered(t, env, notice))
    t.run_retired(run.id)
    assert t.close(timeout_s=2.0) == []  # nothing left undelivered
    assert t.close(timeout_s=2.0) == []  # idempotent: a second close does nothing more
    assert setting.delivered(t, env, notice)  # and took nothing back
    assert t.failures() in (None, 0)


@pytest.mark.parametrize("name", _target_params(down=True))
def test_a_dead_endpoint_never_raises_into_the_watcher_and_is_said(name, env, tmp_path):
    setting = TARGET_SETTINGS[name]
    assert setting.make_down is not None
    log = tmp_path / "runs" / "a" / "events.jsonl"
    _steady_then_nan(log)
    t = setting.make_down(env)
    errors = io.StringIO()
    w = Watcher([str(tmp_path / "runs")], load_policy("default"), [t], errors=errors)
    assert w.poll_once(final=True) >= 1  # the incident was found and handed to the dead target
    w._drain(w.stop, 10)
    w.close(timeout_s=1.0)
    t.close(timeout_s=0.5)  # a second close by its owner: still no exception
    said = errors.getvalue()
    counted = t.failures() or 0
    assert w.lost >= 1 or counted >= 1, said  # the failure is counted somewhere: never silent
    assert "stopped (closed)" in said


# --- the settings: one entry per Monitor sink ------------------------------------------------


@dataclass
class SinkSetting:
    make: Callable[[Path], object]  # tmp_path -> the sink
    delivered: Callable[[object, object, str], bool]  # (sink, tmp_path, incident title): it holds them
    marks: tuple = ()


def _jsonl_sink_delivered(sink, tmp_path, title):
    lines = [json.loads(line) for line in open(tmp_path / "sink.jsonl", encoding="utf-8")]
    kinds = [d["type"] for d in lines]
    return (
        kinds.count("step") == 21
        and "alert" in kinds
        and [d["title"] for d in lines if d["type"] == "incident"] == [title]
    )


def _memory_delivered(sink, tmp_path, title):
    return len(sink.records) == 21 and sink.alerts and [e.title for e in sink.incidents] == [title] and sink.closed


def _console_sink_delivered(sink, tmp_path, title):
    return True  # its lines go to the log: checked by the caplog assertion in the test


def _tensorboard_sink(tmp_path):
    from nummon.integrations.tensorboard import TensorBoardSink

    return TensorBoardSink(tmp_path / "tb")


def _tensorboard_delivered(sink, tmp_path, title):
    return any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").rglob("*"))


def _prometheus_sink(tmp_path):
    from nummon.integrations.prometheus import PrometheusSink

    return PrometheusSink(listen="127.0.0.1:0", run="contract")


def _prometheus_delivered(sink, tmp_path, title):
    return True  # scraped while open, in the test: after close there is no endpoint


def _mlflow_sink(tmp_path):
    from nummon.integrations.mlflow import MlflowSink

    return MlflowSink(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="contract")


def _mlflow_delivered(sink, tmp_path, title):
    from mlflow.tracking import MlflowClient

    run = MlflowClient(sink.client.tracking_uri).get_run(sink.run_id)
    return run.data.tags.get("nummon.state") == "nonfinite"


def _wandb_sink(tmp_path):
    from nummon.integrations.wandb import WandbSink

    return WandbSink(project="nummon-contract")


def _wandb_sink_delivered(sink, tmp_path, title):
    import wandb
    from helpers.wandb_reader import alerts, find_run_file, read_records

    wandb.teardown()
    return title in [a.title for a in alerts(read_records(find_run_file(tmp_path / "wandb_dir")))]


SINK_SETTINGS: dict[str, SinkSetting] = {
    "JsonlSink": SinkSetting(lambda p: nummon.JsonlSink(p / "sink.jsonl"), _jsonl_sink_delivered),
    "MemorySink": SinkSetting(lambda p: nummon.MemorySink(), _memory_delivered),
    "ConsoleSink": SinkSetting(lambda p: nummon.ConsoleSink(), _console_sink_delivered),
    "TensorBoardSink": SinkSetting(_tensorboard_sink, _tensorboard_delivered),
    "PrometheusSink": SinkSetting(_prometheus_sink, _prometheus_delivered),
    "MlflowSink": SinkSetting(_mlflow_sink, _mlflow_delivered, (pytest.mark.slow,)),
    "WandbSink": SinkSetting(_wandb_sink, _wandb_sink_delivered, (pytest.mark.slow,)),
}


def _sink_params():
    return [
        pytest.param(c.__name__, marks=SINK_SETTINGS[c.__name__].marks, id=c.__name__)
        for c in subclasses(BaseSink)
        if c.__name__ in SINK_SETTINGS
    ]


@pytest.mark.parametrize("name", _sink_params())
def test_every_monitor_sink_runs_its_lifecycle_under_a_monitor(name, tmp_path, caplog, wandb_env):
    import logging

    caplog.set_level(logging.INFO, logger="nummon")
    setting = SINK_SETTINGS[name]
    sink = setting.make(tmp_path)
    assert isinstance(sink, nummon.Sink) and type(sink).__name__ == name
    mon = nummon.Monitor(sinks=[sink], run_dir=tmp_path / "run", policy={"alerts": {"stop_on_critical": False}})
    reports = [mon.post_step(2.0 - 0.01 * s) for s in range(20)] + [mon.post_step(float("nan"))]
    assert reports[-1].incidents and reports[-1].alerts  # a record, an alert and an incident went out
    if name == "PrometheusSink":  # its endpoint is live while the Monitor runs
        import urllib.request

        def scraped() -> str:
            return urllib.request.urlopen(cast(Any, sink).url, timeout=5).read().decode()  # a PrometheusSink's url

        nonfinite = re.compile(r'^nummon_health_state\{run="contract",[^}]*\} 3\.0$', re.M)  # 3: non-finite
        _wait_for("the non-finite health on the endpoint", lambda: nonfinite.search(scraped()) is not None)
    mon.close()
    sink.close()  # idempotent: the Monitor's close and an exit handler may both close it
    assert mon.sink_stats[name]["errors"] == 0, mon.sink_stats
    title = reports[-1].incidents[0].title
    if name == "ConsoleSink":
        assert any(title in r.getMessage() for r in caplog.records), caplog.text
    assert setting.delivered(sink, tmp_path, title)
