"""Operator-level interception: every ATen op of the forward and the backward passes through
here; non-finite outputs are traced to the op that made them from finite inputs.

Each non-finite tensor carries an Origin: a *failure* (finite inputs, non-finite output: the
cause lives here), *outside* (it was already non-finite when it entered: the batch, a
parameter) or a *constant* (a deliberate ±inf such as an attention mask). Constants are not
failures until arithmetic turns their infinities into NaN (inf - inf in a fully masked softmax
row). Propagating origins, instead of stopping at the first non-finite op, keeps a harmless
-inf mask from being blamed for a NaN that a later log(0) produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ._causes import Cause, classify, classify_backward, classify_inf_arithmetic, magnitude_cause, op_base
from ._scope import ModuleScope, _storage_ptr, user_location

__all__ = ["NonfiniteInterceptor", "Origin"]

Location = tuple[str, int]
_LIFTS = {"lift_fresh", "lift_fresh_copy", "lift"}  # torch.tensor(float("-inf")) in the user's code
# Outputs that hold whatever was in memory: garbage NaNs there are nobody's cause.
_UNINITIALISED = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "resize",
    "set",
}
# In-place ops that overwrite their first argument whole: its old value is not an input.
_OVERWRITES = {
    "copy",
    "fill",
    "zero",
    "uniform",
    "normal",
    "bernoulli",
    "random",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
}

_OUTSIDE_REMEDIES = {
    "parameter": "the weights are already non-finite, so an earlier update broke them: lower the LR, clip gradients, restore a checkpoint",
    "buffer": "a buffer (e.g. BatchNorm's running statistics) is already non-finite: an earlier step broke it; reset it or restore a checkpoint",
    "data": "clean the batch (drop the bad samples, torch.nan_to_num) or fix the data pipeline that produced it",
}


@dataclass(frozen=True)
class Origin:
    """Where a non-finite value started; `order` ranks origins by time of creation."""

    order: int
    kind: str  # "failure" | "outside" | "constant"
    op: str
    stage: str
    cause: Cause
    location: Location | None
    module: str | None
    forward_op: str | None = None


def _checked(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and (value.is_floating_point() or value.is_complex())
        and value.layout == torch.strided
        and value.device.type != "meta"
    )


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


class NonfiniteInterceptor(TorchDispatchMode):
    """Set `stage` to "backward" before running the backward under the same mode."""

    def __init__(self, scope: ModuleScope) -> None:
        super().__init__()
        self.scope = scope
        self.stage = "forward"
        self._by_id: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._by_storage: dict[int, Origin] = {}  # views and saved tensors are new objects
        # autograd node sequence number -> (forward op, module, location), for the backward.
        self._nodes: dict[int, tuple[str, str | None, Location | None]] = {}
        self._counter = _get_sequence_nr()
        self._order = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):  # higher-order ops (compiled regions): no schema
            return func(*args, **kwargs)
        op = func._schema.name
        if self.stage == "forward":
            self._note_node(op)
        base = op_base(op)
        operands = tree_leaves(args) + tree_leaves({k: v for k, v in kwargs.items() if k != "out"})
        if base in _OVERWRITES and func._schema.is_mutable:
            operands = operands[1:]
        before = {}
        if func._schema.is_mutable:  # an in-place op overwrites the inputs we must judge
            before = {id(a): a.detach().clone() for a in operands if _checked(a)}
        out = func(*args, **kwargs)
        if base in _UNINITIALISED:
            return out
        bad = [t for t in tree_leaves(out) if _checked(t) and not _finite(t)]
        if bad:
            self._trace(func, op, operands, before, bad)
        return out

    def _note_node(self, op: str) -> None:
        """Autograd numbers each node it creates just before dispatching the op below it: a new
        number means this op recorded one; remember its name, module and line for the backward."""
        current = _get_sequence_nr()
        if current != self._counter:
            self._counter = current
            self._nodes[current - 1] = (op, self.scope.current, user_location())

    # -- origins -----------------------------------------------------------------------------
    def origin_of(self, tensor: torch.Tensor) -> Origin | None:
        origin = self._by_id.get(tensor)
        if origin is None:
            ptr = _storage_ptr(tensor)
            origin = self._by_storage.get(ptr) if ptr is not None else None
        return origin

    def _register(self, tensors: list[torch.Tensor], origin: Origin) -> None:
        for tensor in tensors:
            self._by_id[tensor] = origin
            ptr = _storage_ptr(tensor)
            if ptr is not None:
                self._by_storage[ptr] = origin

    def _trace(
        self, func: Any, op: str, operands: list[Any], before: dict[int, torch.Tensor], bad: list[torch.Tensor]
    ) -> None:
        values = [before.get(id(a), a) for a in operands]
        nonfinite = [(a, v) for a, v in zip(operands, values) if _checked(v) and not _finite(v)]
        scalar_nonfinite = [a for a in operands if isinstance(a, float) and not math.isfinite(a)]
        if op_base(op) in _LIFTS or (scalar_nonfinite and not nonfinite):
            shown = scalar_nonfinite[0] if scalar_nonfinite else "a literal"
            cause = (
                "nonfinite_input",
                f"a non-finite constant ({shown}) enters the computation in {op}",
                _inf_remedy(),
            )
            origin = self._new("constant", op, cause)
        elif not nonfinite:
            origin = self._failure(op, values, bad[0])
        else:
            known = [self.origin_of(a) for a, _ in nonfinite]
            unknown = [(a, v) for (a, v), o in zip(nonfinite, known) if o is None]
            roots = [o for o in known if o is not None and o.kind != "constant"]
            if unknown and func.is_view:
                return  # a view of the batch or a weight (aten::t, view): blame the op that computes with it
            if unknown:  # already non-finite when it reached the traced ops
                origin = self._outside(op, *unknown[0])
                self._register([unknown[0][0]], origin)
            elif roots:
                origin = min(roots, key=lambda o: o.order)
            elif any(bool(torch.isnan(t).any()) for t in bad) and not any(
                bool(torch.isnan(v).any()) for _, v in nonfinite
            ):
                origin = self._new("failure", op, classify_inf_arithmetic(op, values))
            else:
                origin = min((o for o in known if o is not None), key=lambda o: o.order)
        self._register(bad, origin)

    def _new(self, kind: str, op: str, cause: Cause, *, forward_op: str | None = None) -> Origin:
        self._order += 1
        if self.stage == "backward":
            forward_op, module, location = self._forward_of_current_node()
        else:
            module, location = self.scope.current, user_location()  # the stack walk: failing ops only
        return Origin(self._order, kind, op, self.stage, cause, location, module, forward_op)

    def _forward_of_current_node(self) -> tuple[str | None, str | None, Location | None]:
        node = torch._C._current_autograd_node()
        if node is None:
            return None, None, None
        return self._nodes.get(node._sequence_nr(), (node.name(), None, None))

    def _failure(self, op: str, values: list[Any], out: torch.Tensor) -> Origin:
        if self.stage == "backward":
            forward_op = self._forward_of_current_node()[0]
            cause = classify_backward(op, forward_op, values, out)
        else:
            cause = classify(op, values, out)
        if cause[0] == "overflow" and cause[1].startswith("inputs to "):
            # a sum or product of finite operands: which operand carries the magnitude
            dtype = out.dtype if out.is_floating_point() else torch.float32
            tensors = [v for v in values if _checked(v)]
            backward = self.stage == "backward"
            roles = [self.scope.role(t) for t in tensors]
            if backward:  # a tensor nobody named in the backward is a gradient
                roles = [("gradients", "a gradient") if r == ("activations", "an activation") else r for r in roles]
            cause = magnitude_cause(op_base(op), tensors, dtype, roles, self.scope.largest_parameter(), backward)
        bad = int((~torch.isfinite(out)).sum())
        counted = f"; {bad} of the {out.numel()} elements of its output are non-finite"
        return self._new("failure", op, (cause[0], cause[1] + counted, cause[2]))

    def _outside(self, op: str, tensor: torch.Tensor, value: torch.Tensor) -> Origin:
        named = self.scope.describe(tensor)
        if named is None:
            return self._new("outside", op, describe_outside(None, value))
        return self._new("outside", op, describe_outside(named[0], named[1].detach()))


def describe_outside(source: str | None, value: torch.Tensor) -> Cause:
    """nonfinite_input: what the bad tensor is, how much of it is bad, and what to do."""
    nans, infs = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
    source = source or "a tensor created outside the explained call"
    text = f"{source} (shape {tuple(value.shape)}) holds {nans} NaN and {infs} inf among {value.numel()} values"
    kind = source.split(" ", 1)[0]
    return ("nonfinite_input", text, _OUTSIDE_REMEDIES.get(kind, _OUTSIDE_REMEDIES["data"]))


def _inf_remedy() -> str:
    return "if the infinity is meant (a mask), use torch.finfo(dtype).min instead of ±inf so no arithmetic meets it"
