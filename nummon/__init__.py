"""nummon: a numerical-health monitor for PyTorch training.

``Monitor`` (and anything else that needs torch) is imported lazily, so ``nummon replay`` and
the detectors run without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import NummonError
from ._policy import Policy, PolicyError, load_policy, preset_names
from ._replay import replay
from ._sinks import BaseSink, ConsoleSink, JsonlSink, MemorySink, Sink
from ._trace import TraceError, read_trace
from ._types import Alert, AlertKind, Health, Severity, StepRecord, StepReport

__version__ = "0.1.0"

__all__ = [
    "Alert",
    "AlertKind",
    "BaseSink",
    "ConsoleSink",
    "DistributedError",
    "Health",
    "JsonlSink",
    "MemorySink",
    "Monitor",
    "NummonError",
    "Policy",
    "PolicyError",
    "Severity",
    "Sink",
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
]

# imported on first use: Monitor needs torch, the integrations their backends
_LAZY = {
    "Monitor": "._monitor",
    "DistributedError": "._distributed",
    "TensorBoardSink": ".integrations.tensorboard",
    "WandbSink": ".integrations.wandb",
}

if TYPE_CHECKING:
    from ._distributed import DistributedError
    from ._monitor import Monitor
    from .integrations.tensorboard import TensorBoardSink
    from .integrations.wandb import WandbSink


def __getattr__(name: str) -> Any:
    if name == "diagnose":  # the checklist module (needs torch)
        import importlib

        return importlib.import_module(".diagnose", __name__)
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nummon' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
