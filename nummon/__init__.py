"""nummon: a numerical-health monitor for PyTorch training.

``Monitor`` (and anything else that needs torch) is imported lazily, so ``nummon replay`` and
the detectors run without torch.
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

# a source checkout's integrations/ and configs/ join the package: see pyproject.toml, [tool.setuptools.package-dir]
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "configs")) and all(
    _os.path.isfile(_os.path.join(_root, d, "__init__.py")) for d in ("integrations", "configs")
):
    __path__.append(_root)  # nummon.integrations, nummon.configs
del _root

from ._core.errors import DistributedError, NummonError, StateError, TraceError
from ._core.events import Contributor, IncidentEvent, StepReport
from ._core.types import Alert, AlertKind, Health, IncidentState, Severity, StepRecord
from ._core.version import __version__ as __version__
from ._logs.trace import read_trace
from ._policy.policy import Policy, PolicyError, load_policy, preset_names
from ._sinks.builtin import BaseSink, ConsoleSink, JsonlSink, MemorySink, RunContext, Sink
from ._tools.replay import replay

__all__ = [
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
]

# imported on first use: Monitor needs torch, the integrations their backends
_LAZY = {
    "Monitor": "._monitor.monitor",
    "MicroBatches": "._forensics.verdict",
    "TensorBoardSink": ".integrations.tensorboard",
    "PrometheusSink": ".integrations.prometheus",
    "WandbSink": ".integrations.wandb",
    "MlflowSink": ".integrations.mlflow",
}

if TYPE_CHECKING:
    from ._forensics.verdict import MicroBatches
    from ._monitor.monitor import Monitor
    from .integrations.mlflow import MlflowSink
    from .integrations.prometheus import PrometheusSink
    from .integrations.tensorboard import TensorBoardSink
    from .integrations.wandb import WandbSink


# the public classes and functions report the module users import them from (httpx's way)
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) or callable(_obj):
        _obj.__module__ = __name__
del _name, _obj


def __getattr__(name: str) -> Any:
    if name == "diagnose":  # the checklist module (needs torch)
        import importlib

        return importlib.import_module(".diagnose", __name__)
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        if name in ("Monitor", "MicroBatches"):
            value.__module__ = __name__  # the integrations' classes keep their nummon.integrations.X
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nummon' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
