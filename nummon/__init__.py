"""nummon: a numerical-health monitor for PyTorch training.

``Monitor`` (and anything else that needs torch) is imported lazily, so ``nummon replay`` and
the detectors run without torch.
"""
from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

# A source checkout keeps integrations/ and configs/ beside nummon/ (the project's layout); an
# install maps them into the package (pyproject's package-dir). Let `python -m nummon` run from
# the checkout's root, where the source tree shadows the install, resolve them the same way.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "configs")) and all(
    _os.path.isfile(_os.path.join(_root, d, "__init__.py")) for d in ("integrations", "configs")
):
    __path__.append(_root)  # type: ignore[name-defined]  # nummon.integrations, nummon.configs
del _root

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
    "PrometheusSink",
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
    "PrometheusSink": ".integrations.prometheus",
    "WandbSink": ".integrations.wandb",
}

if TYPE_CHECKING:
    from ._distributed import DistributedError
    from ._monitor import Monitor
    from .integrations.prometheus import PrometheusSink
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
