"""explain_nonfinite: run one failing step again under the interceptor and say why it failed.

Meant for the failing step only: nothing is installed before or after the call, so healthy
steps pay nothing. The user's parameters, `.grad` fields, buffers and RNG states come out as
they went in (the backward uses torch.autograd.grad, which never writes `.grad`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils._pytree import tree_leaves

from .._core.errors import NummonError
from ._explanation import NonfiniteReport
from ._interceptor import NonfiniteInterceptor, Origin, _checked, _finite, describe_outside
from ._rng import Generators
from ._scope import ModuleScope, source_text

__all__ = ["explain_nonfinite"]


def explain_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonfiniteReport | None:
    """Run `fn(*args, **kwargs)` (a forward returning a loss, e.g. `lambda: loss_fn(model(x), y)`)
    and, when its result requires grad, the backward to the leaf tensors it depends on. Returns
    the first operator that made the result or a gradient non-finite, with the cause, the user's
    line, the module, the numbers and a remedy; None when the result and all gradients are finite.

    `fn` must not call .backward() or step an optimizer itself. For the same dropout masks as the
    failing step, call this with the RNG state that step started from; the state is restored after.
    """
    if not callable(fn):
        raise NummonError(
            f"explain_nonfinite: fn must be callable (a forward returning a loss), got {type(fn).__name__}"
        )
    return explain_in(None, fn, *args, **kwargs)


def explain_in(model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonfiniteReport | None:
    """`explain_nonfinite` with the modules named by their qualified names in `model` (the model
    nummon watches; None: by their paths in the outermost module that runs)."""
    rng = Generators()
    scope = ModuleScope(model)
    for index, value in enumerate(tree_leaves((args, kwargs))):
        if isinstance(value, torch.Tensor):
            scope.inputs.append((value, f"argument {index} of fn"))
    scope.install()
    try:
        interceptor = NonfiniteInterceptor(scope)
        with interceptor:
            result = fn(*args, **kwargs)
            losses = _loss_tensors(result)
            origin = _first_nonfinite(interceptor, losses)
            outputs = [t for t in losses if t.requires_grad]
            if origin is None and outputs:
                scope.remove()  # the backward runs no module forwards
                interceptor.stage = "backward"
                leaves = _leaves(outputs)
                if leaves:
                    grads = torch.autograd.grad(
                        outputs, leaves, grad_outputs=[torch.ones_like(t) for t in outputs], allow_unused=True
                    )
                    origin = _first_nonfinite(interceptor, [g for g in grads if g is not None])
    finally:
        scope.remove()
        scope.restore_buffers()
        rng.restore()
    return _report(origin) if origin is not None else None


def _loss_tensors(result: Any) -> list[torch.Tensor]:
    """The loss inside `result`: its first floating scalar (a dict or a model output with a
    "loss" and "logits" is judged by the loss), else all its floating tensors."""
    tensors = [t for t in tree_leaves(result) if _checked(t)]
    scalars = [t for t in tensors if t.numel() == 1]
    return scalars[:1] if scalars else tensors


def _first_nonfinite(interceptor: NonfiniteInterceptor, values: list[Any]) -> Origin | None:
    """The earliest origin among the non-finite tensors in `values`."""
    origins = []
    for value in values:
        if _checked(value) and not _finite(value):
            origin = interceptor.origin_of(value)
            if origin is None:  # fn returned a tensor that no traced op produced
                origin = Origin(
                    0,
                    "outside",
                    "(none)",
                    interceptor.stage,
                    describe_outside("the value fn returned", value),
                    None,
                    None,
                )
            origins.append(origin)
    return min(origins, key=lambda o: o.order) if origins else None


def _leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (parameters, inputs with requires_grad) that `outputs` depend on."""
    leaves: list[torch.Tensor] = []
    seen: set[Node] = set()
    pending: list[Node | None] = [t.grad_fn for t in outputs if t.grad_fn is not None]  # next_functions hold None
    leaves += [t for t in outputs if t.grad_fn is None and t.requires_grad]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _report(origin: Origin) -> NonfiniteReport:
    cause, ranges, remedy = origin.cause
    location = f"{origin.location[0]}:{origin.location[1]}" if origin.location else None
    return NonfiniteReport(
        op=origin.op,
        stage=origin.stage,
        cause=cause,
        location=location,
        module=origin.module,
        input_ranges=ranges,
        remedy=remedy,
        forward_op=origin.forward_op if origin.stage == "backward" else None,
        source=source_text(origin.location),
    )
