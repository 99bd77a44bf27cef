"""The public surface is pinned, and importing nummon pulls in no optional backend."""
import subprocess
import sys

import nummon

EXPECTED = {
    "Alert", "AlertKind", "BaseSink", "ConsoleSink", "DistributedError", "Health", "JsonlSink", "MemorySink", "Monitor", "NummonError",
    "Policy", "PolicyError", "PrometheusSink", "Severity", "Sink", "StepRecord", "StepReport", "TensorBoardSink", "TraceError", "WandbSink",
    "diagnose", "load_policy", "preset_names", "read_trace", "replay",
}


def test_all_is_pinned_and_resolves():
    assert set(nummon.__all__) == EXPECTED
    for name in nummon.__all__:
        assert getattr(nummon, name) is not None


def test_import_nummon_imports_no_torch_wandb_or_tensorboard():
    code = (
        "import sys, nummon; "
        "bad = [m for m in ('torch', 'wandb', 'tensorboard', 'tensorboardX', 'prometheus_client') if m in sys.modules]; "
        "print('LOADED', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "LOADED []" in out


def test_monitor_import_does_not_pull_backends():
    code = (
        "import sys, nummon; nummon.Monitor; nummon.diagnose; "
        "print('LOADED', [m for m in ('wandb', 'tensorboard', 'lightning', 'pytorch_lightning', 'transformers', "
        "'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "LOADED []" in out
