"""`torch.compile`d models: the module to watch behind the wrapper, and whether a hook is being
traced.

A compiled model runs its modules' forward hooks inside the compiled graph: dynamo traces them
once, and guards on the module's hooks and on the torch-function mode stack. A hook that makes a
per-step Python decision, registers hooks, or enters a mode then breaks the graph or recompiles
it on every sampled step. So on a compiled model the mechanism probes leave the forward alone.
The activation probes' hook traces into the graph as it is (no break, no recompile per step).
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

__all__ = ["has_compiled_parts", "is_compile_wrapper", "tracing", "unwrap_compiled", "warn_at_user_line"]

# frames in these folders are not the user's: nummon's own and torch's (module calls, hooks)
_NOT_USER = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def is_compile_wrapper(m: nn.Module) -> bool:
    """Whether `m` is what `torch.compile(module)` returns (torch._dynamo's OptimizedModule,
    recognised without importing torch._dynamo: a second of import time)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module)


def unwrap_compiled(model: nn.Module | None) -> nn.Module | None:
    """The module a `torch.compile(model)` wrapper holds (its parameters and submodules under
    their own names, not `_orig_mod.`), or the model itself."""
    while model is not None and is_compile_wrapper(model):
        model = model._orig_mod
    return model


def has_compiled_parts(model: nn.Module) -> bool:
    """Whether the model or one of its submodules is compiled: a `torch.compile` wrapper or a
    module compiled in place (`module.compile()`)."""
    return any(is_compile_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def tracing() -> bool:
    """Whether this code is being traced by `torch.compile` (not run eagerly)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def warn_at_user_line(message: str) -> None:
    """A UserWarning pointing at the innermost line of the user's code on the stack (the call of
    the model, `Monitor(...)` or `post_step`), not at nummon's or torch's own frames."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_USER):
        frame = frame.f_back
    filename, line = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("nummon", 0)
    warnings.warn_explicit(message, UserWarning, filename, line)
