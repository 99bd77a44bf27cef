"""The public surface is pinned, and importing nummon pulls in no optional backend."""

import importlib
import subprocess
import sys

import pytest

import nummon

EXPECTED = {
    "Alert",
    "AlertKind",
    "BaseSink",
    "ConsoleSink",
    "Contributor",
    "DistributedError",
    "Health",
    "IncidentEvent",
    "IncidentState",
    "JsonlSink",
    "MemorySink",
    "MicroBatches",
    "MlflowSink",
    "Monitor",
    "NummonError",
    "Policy",
    "PolicyError",
    "PrometheusSink",
    "RunContext",
    "Severity",
    "Sink",
    "StateError",
    "StepRecord",
    "StepReport",
    "TensorBoardSink",
    "TraceError",
    "WandbSink",
    "diagnose",
    "load_policy",
    "preset_names",
    "read_trace",
    "replay",
}
INTEGRATIONS = {
    "TensorBoardSink": "nummon.integrations.tensorboard",
    "WandbSink": "nummon.integrations.wandb",
    "PrometheusSink": "nummon.integrations.prometheus",
    "MlflowSink": "nummon.integrations.mlflow",
}


def test_all_is_pinned_sorted_and_resolves():
    assert nummon.__all__ == sorted(EXPECTED)
    for name in nummon.__all__:
        assert getattr(nummon, name) is not None


def test_public_classes_and_functions_report_the_module_users_import_them_from():
    for name in sorted(EXPECTED - {"diagnose"}):
        assert getattr(nummon, name).__module__ == INTEGRATIONS.get(name, "nummon"), name


def test_every_error_is_a_nummon_error():
    for name in ("DistributedError", "PolicyError", "StateError", "TraceError"):
        assert issubclass(getattr(nummon, name), nummon.NummonError), name
    assert issubclass(nummon.DistributedError, RuntimeError)  # what it was before: handlers keep working


def test_public_fields_are_typed_with_the_public_types():
    import typing

    assert typing.get_type_hints(nummon.StepReport)["incidents"] == tuple[nummon.IncidentEvent, ...]
    assert typing.get_type_hints(nummon.IncidentEvent)["state"] is nummon.IncidentState
    assert typing.get_type_hints(nummon.IncidentEvent)["contributors"] == tuple[nummon.Contributor, ...]
    assert typing.get_type_hints(nummon.BaseSink.on_incident)["event"] is nummon.IncidentEvent
    assert typing.get_type_hints(nummon.Monitor.incidents.fget)["return"] == list[nummon.IncidentEvent]
    for method in ("bind", "on_step", "on_histograms", "on_alert", "on_incident", "flush", "close"):
        assert hasattr(nummon.Sink, method) and hasattr(nummon.BaseSink, method), method
    assert isinstance(nummon.JsonlSink("x.jsonl"), nummon.Sink) and nummon.JsonlSink.durable
    assert not nummon.MemorySink.durable and not nummon.ConsoleSink.durable


def test_import_nummon_imports_no_torch_wandb_or_tensorboard():
    code = (
        "import sys, nummon; "
        "bad = [m for m in ('torch', 'wandb', 'tensorboard', 'tensorboardX', 'prometheus_client') if m in sys.modules]; "
        "print('LOADED', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "LOADED []" in out


@pytest.mark.slow
def test_monitor_import_does_not_pull_backends():
    code = (
        "import sys, nummon; nummon.Monitor; nummon.diagnose; "
        "print('LOADED', [m for m in ('wandb', 'tensorboard', 'lightning', 'pytorch_lightning', 'transformers', "
        "'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "LOADED []" in out


@pytest.mark.parametrize(
    ("module", "new"),
    [
        ("nummon.integrations.lightning", "NummonLightningCallback"),
        ("nummon.integrations.transformers", "NummonTrainerCallback"),
    ],
)
def test_each_framework_callback_has_its_own_name_and_the_old_one_warns(module, new):
    mod = importlib.import_module(module)
    assert mod.__all__ == [new]
    with pytest.warns(DeprecationWarning, match=f"renamed {new}"):
        old = mod.NummonCallback
    assert old is getattr(mod, new)
    with pytest.raises(AttributeError):
        mod.NoSuchCallback  # noqa: B018
