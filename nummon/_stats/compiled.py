"""`torch.compile`d models: the module to watch behind the wrapper, and whether a hook is being
traced.

A compiled model runs its modules' forward hooks inside the compiled graph: dynamo traces them
once, and guards on the module's hooks and on the torch-function mode stack. A hook that
registers hooks or enters a mode then breaks the graph or recompiles it on every sampled step.
So on a compiled model the forward's mechanism probes keep the sampled step's inputs (a side
effect that traces cleanly) and replay its first sample eagerly when the step is taken
(`first_sample`, `replayed`). The activation probes' hook traces into the graph as it is (no
break, no recompile per step), and stays registered on every step: dynamo does not see a hook
added after it compiled, and recompiles when one is removed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from .capture_plan import SAME_VALUES

__all__ = [
    "autocast_state",
    "can_replay",
    "first_sample",
    "has_batch_norm",
    "loss_reads_compiled_output",
    "has_compiled_parts",
    "is_compile_wrapper",
    "replayed",
    "tracing",
    "untraced",
    "unwrap_compiled",
    "warn_at_user_line",
]

# frames in these folders are not the user's: nummon's own and torch's (module calls, hooks)
_NOT_USER = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def is_compile_wrapper(m: nn.Module) -> bool:
    """Whether `m` is what `torch.compile(module)` returns (torch._dynamo's OptimizedModule,
    recognised without importing torch._dynamo: a second of import time)."""
    return type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module)


def unwrap_compiled(model: nn.Module | None) -> nn.Module | None:
    """The module a `torch.compile(model)` wrapper holds (its parameters and submodules under
    their own names, not `_orig_mod.`), or the model itself."""
    while model is not None and is_compile_wrapper(model):
        model = cast(nn.Module, model._orig_mod)  # `is_compile_wrapper` checked it is a Module
    return model


def has_compiled_parts(model: nn.Module) -> bool:
    """Whether the model or one of its submodules is compiled: a `torch.compile` wrapper or a
    module compiled in place (`module.compile()`)."""
    # an explicit walk over `_modules` (every module reachable, each once, as `modules()` yields
    # them): `modules()` is a generator per level and builds every module's name, ~5 Python calls
    # a module, and this runs on every sampled forward
    seen: set[int] = set()
    stack: list[nn.Module | None] = [model]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:  # (a child slot may hold None)
            continue
        seen.add(id(m))
        if getattr(m, "_compiled_call_impl", None) is not None or (
            type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module)
        ):  # (`is_compile_wrapper`, inline: a call per module)
            return True
        stack.extend(m._modules.values())
    return False


def tracing() -> bool:
    """Whether this code is being traced by `torch.compile` (not run eagerly)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` kept out of `torch.compile`'s trace (`torch.compiler.disable`): on a compiled model a
    module hook runs inside the compiled forward, where its reads of Python state become guards
    (a recompile each time a counter or flag changes; a cache of 8 recompiles, then eager) and
    calls dynamo skips break the graph. Untraced, it runs eagerly between graphs."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if callable(disable) else hook


def warn_at_user_line(message: str) -> None:
    """A UserWarning pointing at the innermost line of the user's code on the stack (the call of
    the model, `Monitor(...)` or `post_step`), not at nummon's or torch's own frames."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_USER):
        frame = frame.f_back
    filename, line = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("nummon", 0)
    warnings.warn_explicit(message, UserWarning, filename, line)


def can_replay() -> bool:
    """Whether compiled code can be made to run eagerly (`torch.compiler.set_stance`, torch 2.6+)."""
    return callable(getattr(getattr(torch, "compiler", None), "set_stance", None))


def first_sample(args: tuple, kwargs: dict, samples: int = 1) -> tuple[tuple, dict]:
    """A forward's arguments cut to their first `samples`: every tensor whose first dimension is
    the batch's (that of the first tensor with a dimension) keeps its first rows; the rest, and
    a batch no larger, are left as they are."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.ndim]
    n = leaves[0].shape[0] if leaves else 1
    if n <= samples:
        return args, kwargs

    def cut(t: Any) -> Any:
        return t[:samples] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == n else t

    return tree_map(cut, args), tree_map(cut, kwargs)


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions in force, as (device type, dtype) pairs (traces as a constant)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d))


def has_batch_norm(model: nn.Module) -> bool:
    """Whether a batch-norm layer is in the model: in train mode it needs two samples or more."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@contextlib.contextmanager
def replayed(model: nn.Module, autocast: tuple[tuple[str, torch.dtype], ...] = ()) -> Iterator[None]:
    """A forward of `model` that leaves no trace: compiled parts run eagerly, with no gradient,
    under the `autocast` regions the original forward ran in, and the random generators (CPU,
    the model's CUDA device) and the buffers (batch-norm statistics) are as they were after it.
    Train mode is kept: a module's eval path may differ (nn.MultiheadAttention's fused fast path)."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = {t.device.index or 0 for t in itertools.chain(model.parameters(), model.buffers()) if t.is_cuda}
    cuda_states = [(i, torch.cuda.get_rng_state(i)) for i in sorted(cuda)]
    try:
        with contextlib.ExitStack() as regions:
            for device_type, dtype in autocast:
                regions.enter_context(torch.autocast(device_type, dtype=dtype))
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu)
        for i, state in cuda_states:
            torch.cuda.set_rng_state(state, i)


# between a loss and its log-softmax: reductions and scalings of the loss (a mean, a division
# for gradient accumulation, label smoothing's sum)
_LOSS_SIDE = {
    "NllLossBackward0",
    "NllLoss2DBackward0",
    "MeanBackward0",
    "SumBackward0",
    "DivBackward0",
    "MulBackward0",
    "MulBackward1",
    "AddBackward0",
}


def _first_input(node: Any) -> Any:
    return next((f for f, _ in node.next_functions if f is not None), None)


def loss_reads_compiled_output(loss: Any) -> bool:
    """Whether `loss` is a cross-entropy (a log-softmax) of values that came straight, through
    views and casts only, out of a compiled graph: the logits of a compiled model whose loss is
    computed outside it, which its replayed forward returns (readable after backward)."""
    node = getattr(loss, "grad_fn", None)
    for _ in range(8):
        if node is None or type(node).__name__ == "LogSoftmaxBackward0":
            break
        name = type(node).__name__
        node = _first_input(node) if name in _LOSS_SIDE or name in SAME_VALUES else None
    if node is None or type(node).__name__ != "LogSoftmaxBackward0":
        return False
    node = _first_input(node)
    while node is not None and type(node).__name__ in SAME_VALUES:
        node = _first_input(node)
    return node is not None and type(node).__name__.startswith("CompiledFunction")
